"""A Docker engine and the project's images, for the tests (and benchmarks) that need them.

Docker Hub is unreachable on the machines that run CI: the shared tool ``../shared/docker-sandbox``
(next to the checkout, as CI lays it out) starts dockerd and builds local stand-ins for the
registry's base images under their official names (its README says what each really is). This
module starts it when no engine answers, remembers whether it did (so only then is the engine
stopped again), and builds the project's two images.

    engine = Engine.start()            -> an answering engine; engine.started: whether we did it
    build("server", SERVER_IMAGE)      -> seconds it took (the layer cache makes a rebuild quick)
    Stages()                           -> times named stages and prints them

Nothing here imports pytest: the tests turn a ``Missing`` into a skip (or, under CI, a failure)
through needs.py, a benchmark into an exit with its message.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from contextlib import contextmanager

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The shared tool, beside the checkout (``../shared``), as on developers' machines and in CI.
SANDBOX = os.path.join(os.path.dirname(ROOT), "shared", "docker-sandbox")
#: The tags the tests build under: images of this checkout, the GPU client's on CPU torch.
SERVER_IMAGE = os.environ.get("ZWDX_TEST_SERVER_IMAGE", "zwdx-server:test")
CLIENT_IMAGE = os.environ.get("ZWDX_TEST_CLIENT_IMAGE", "zwdx-gpu-client:test-cpu")
#: The PyTorch base the GPU-client image is built on here (the sandbox's CPU stand-in).
TORCH_IMAGE = os.environ.get("ZWDX_TEST_TORCH_IMAGE", "local/torch-cpu:2.13.0")
HOW = (f"run {os.path.join(SANDBOX, 'up.sh')} as root (it starts dockerd and builds the base images), "
       "or start a Docker engine")


class Missing(Exception):
    """What is missing for a Docker test, and how to get it (``str``: both)."""

    def __init__(self, what: str, how: str = HOW):
        super().__init__(f"{what}: {how}")
        self.what, self.how = what, how


def docker(*args: str, timeout: float = 600, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    """``docker ARGS`` (text output captured); CalledProcessError with its output on failure."""
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and done.returncode != 0:
        raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)
    return done


def answers() -> bool:
    """Whether a Docker engine answers the ``docker`` command."""
    if shutil.which("docker") is None:
        return False
    try:
        return docker("version", "--format", "{{.Server.Version}}", timeout=20, check=False).returncode == 0
    except subprocess.TimeoutExpired:
        return False


class Engine:
    """An answering Docker engine; ``started`` when this process started it (and so stops it)."""

    def __init__(self, started: bool, seconds: float):
        self.started, self.seconds = started, seconds

    @classmethod
    def start(cls) -> "Engine":
        """The engine, started with the shared tool when none answers; its base images made
        where they are missing (the tool is idempotent: a few seconds when all is there)."""
        t0, was_up = time.time(), answers()
        up = os.path.join(SANDBOX, "up.sh")
        if not os.path.exists(up):
            if was_up:  # an engine of the developer's own: the base images must be there already
                return cls(False, time.time() - t0)
            raise Missing("a Docker engine (none answers, and the shared tool is not at ../shared/docker-sandbox)")
        if not was_up and os.geteuid() != 0:
            raise Missing("a Docker engine (none answers; starting one needs root)")
        done = subprocess.run([up], capture_output=True, text=True, timeout=1200)
        if done.returncode != 0 or not answers():
            raise Missing(f"a Docker engine ({up} failed: {done.stderr[-2000:]}{done.stdout[-2000:]})",
                          "see the tool's README and its dockerd.log")
        return cls(not was_up, time.time() - t0)

    def stop(self) -> None:
        """Stop the engine if this process started it (by the pid the tool recorded)."""
        if self.started:
            subprocess.run([os.path.join(SANDBOX, "down.sh")], capture_output=True, timeout=60)
            self.started = False


def build(target: str, tag: str, **build_args: str) -> float:
    """Build the Dockerfile's ``target`` as ``tag`` from this checkout; seconds it took."""
    t0 = time.time()
    args = [f"--build-arg={k}={v}" for k, v in build_args.items()]
    docker("build", "-q", "--target", target, *args, "-t", tag, ROOT, timeout=1800)
    return time.time() - t0


def build_client_image(tag: str = CLIENT_IMAGE) -> float:
    """The GPU-client image on CPU torch (what runs here: no GPU, no CUDA image)."""
    return build("gpu-client", tag, TORCH_IMAGE=TORCH_IMAGE)


class Stages:
    """Named stages, timed: ``with stages("build"): ...``; ``str(stages)`` one line of them all."""

    def __init__(self, title: str):
        self.title = title
        self.times: list[tuple[str, float]] = []
        self.t0 = time.time()

    @contextmanager
    def __call__(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.times.append((name, time.time() - start))
            print(f"{self.title}: {name} {self.times[-1][1]:.1f} s", flush=True)

    def __str__(self) -> str:
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.times)
        return f"{self.title}: {parts}; total {time.time() - self.t0:.1f} s"


#: The reverse proxy of docker-compose's tls profile, under its official name.
CADDY_IMAGE = "caddy:2"
#: A stand-in for it where the registry is unreachable: Debian's caddy package, laid out as the
#: official image is (data in /data, config in /config, wget for the healthcheck). For tests only.
CADDY_STAND_IN = """\
FROM debian:bookworm-slim
COPY *.crt /usr/local/share/ca-certificates/
RUN apt-get update \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends caddy wget ca-certificates \\
 && update-ca-certificates && rm -rf /var/lib/apt/lists/* && mkdir -p /config /data /etc/caddy /srv
ENV XDG_CONFIG_HOME=/config XDG_DATA_HOME=/data
WORKDIR /srv
EXPOSE 80 443
CMD ["caddy", "run", "--config", "/etc/caddy/Caddyfile", "--adapter", "caddyfile"]
"""


def caddy_image(workdir: str) -> float:
    """``caddy:2``: there already, else the stand-in built (seconds it took). The CA certificates
    of this machine go in, as the shared tool's stand-ins have them (apt may go through a proxy
    that re-signs)."""
    t0 = time.time()
    if docker("image", "inspect", CADDY_IMAGE, check=False).returncode == 0:
        return 0.0
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "Dockerfile"), "w") as fh:
        fh.write(CADDY_STAND_IN)
    certs = "/usr/local/share/ca-certificates"
    found = [f for f in (os.listdir(certs) if os.path.isdir(certs) else []) if f.endswith(".crt")]
    for name in found:
        shutil.copy(os.path.join(certs, name), workdir)
    if not found:
        open(os.path.join(workdir, "none.crt"), "w").close()
    docker("build", "-q", "-t", CADDY_IMAGE, workdir, timeout=1200)
    return time.time() - t0
