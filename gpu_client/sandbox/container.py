"""The ``docker`` isolation (``zwdx gpu-client --isolation docker``, ``kinds.build("docker")``):
each rank of a job runs in a fresh container, started through the Docker SDK and confined as a
donor who runs strangers' code would want (``Confinement``):

- an image the donor allows (``--allow-image``, the first one the default);
- the rank's GPU only (a device request for its index; inside, it is ``cuda:0``), or no GPU; a
  script job's rank gets the job's GPUs of this client (torchrun's ``LOCAL_RANK`` picks one);
- a non-root uid of its own per container, a read-only root filesystem, every capability
  dropped, no-new-privileges, Docker's default seccomp profile, an init as pid 1;
- pids and memory limits (no swap), a bounded /dev/shm;
- a private tmpfs over the agent's directory of sandboxes (``rank_dir``), holding the job's
  sandbox at the path it has on the host (its bundle, the CA file, its datasets, its
  checkpoints and outputs) and nothing of the host; of the agent's environment only what
  libraries read;
- the host's network (peers elsewhere reach its rendezvous and collective ports), egress
  limited to the server's port and the job's peers' rendezvous and collective ports where the
  agent may set iptables rules (egress.py, ``destinations``).

It has the interface of the other kinds (check, kind, label, importable, popen, lease, share,
release, signal): ``popen`` answers a ``RankContainer`` (rank_container.py) that the launcher
treats as a rank process. The sandbox is a directory on the host and, at the same path, in the
container's tmpfs: what the agent ``share``s into it on the host (bundle, CA file, datasets) is
streamed into the container's once the bundle is there.
Containers are removed when their rank ends (``auto_remove``), end themselves when their agent
is gone (the stream ends), and those of an agent killed before it could stop them are removed
when an agent of that work dir starts again (``reap``).
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlparse

from zwdx.protocol.rank import RankSpec
from zwdx.protocol.vocab import Isolation

from .egress import Egress
from .isolation import IsolationError, ProcessIsolation
from .rank_container import RankContainer

log = logging.getLogger("gpu_client.sandbox.container")

#: The image a donor's agent runs ranks in unless told otherwise (run_gpu_client.sh builds it).
DEFAULT_IMAGE = "zwdx-gpu-client"
#: Variables of the agent's environment a rank container gets (what libraries read themselves).
PASSED = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ZWDX_STANDBY_WARMUP", "NCCL_DEBUG",
          "PYTHONUNBUFFERED", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
#: Containers' uids: ``uid_base`` + a number free among the agent's live containers.
UIDS_PER_AGENT = 256


class ContainerError(IsolationError):
    """The Docker engine or an image cannot do what the isolation needs (the message says why)."""


@dataclass
class Confinement:
    """What a rank container may use. Sizes in bytes."""
    images: list[str] = field(default_factory=lambda: [DEFAULT_IMAGE])
    memory: int | None = None      # None: the host's RAM shared out over the slots
    pids: int = 4096
    shm: int = 2 * 1024**3
    work: int | None = None        # tmpfs size of /work; None: as much as memory
    uid_base: int | None = None    # None: one of the agent's own, from its work dir

    @property
    def image(self) -> str:
        return self.images[0]


def engine():
    """A Docker SDK client of an answering engine, or ContainerError saying why there is none."""
    try:
        import docker
    except ImportError as exc:
        raise ContainerError(f"--isolation docker: the docker package is not installed ({exc})") from exc
    try:
        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except Exception as exc:
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        raise ContainerError(f"--isolation docker: no Docker engine answers ({where}: {exc})") from exc


def usable(images: list[str] | None = None) -> str | None:
    """None when the default isolation may be ``docker``; else why not."""
    image = (images or [DEFAULT_IMAGE])[0]
    if in_container():
        return "this GPU client runs in a container itself"
    try:
        client = engine()
    except ContainerError as err:
        return str(err)
    try:
        client.images.get(image)
    except Exception:
        return f"image {image} is not on this machine (docker build --target gpu-client -t {image} .)"
    finally:
        client.close()
    return None


def in_container() -> bool:
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


def agent_tag(work_dir: str) -> str:
    """The label value of an agent's containers (``zwdx.agent``), and its iptables chains' tag:
    one per work dir, so that the agent started again there finds what an earlier run left."""
    return hashlib.sha256(os.path.abspath(work_dir).encode()).hexdigest()[:10]


class DockerIsolation(ProcessIsolation):
    """Each rank in a container of its own (see the module)."""

    kind = Isolation.DOCKER
    label = "container"
    streams_bundle = False  # its files travel to the container whole, over its stdin
    hands_sockets = False  # a container's stream carries bytes only: its rank binds its ports itself

    def __init__(self, work_dir: str, confinement: Confinement | None = None, server: str | None = None,
                 slots: int = 1, rank_dir: str | None = None):
        super().__init__(rank_dir or os.path.join(work_dir, "ranks"), work_dir)
        self.confinement = confinement or Confinement()
        self.server, self.slots = server, max(1, slots)
        self.tag = agent_tag(work_dir)
        #: The uid of the agent's first container; far above any login's, one range per work dir.
        self.uid_base = self.confinement.uid_base or 2_000_000 + int(self.tag, 16) % 8000 * UIDS_PER_AGENT
        self.docker = None
        self.images: dict[str, str] = {}
        self.memory = self.confinement.memory or 0
        self.egress: Egress | None = None
        self.live: dict[int, RankContainer] = {}      # uid -> container
        self._versions: dict | None = None
        self._modules: list[str] | None = None
        self._lock = threading.Lock()

    # -- the agent's start -------------------------------------------------------------------------
    def check(self) -> None:
        """An engine, the allowed images, a probe of the default one (the zwdx and Python it runs),
        the containers an earlier run left removed, the egress chain: or a ContainerError."""
        super().check()
        self.docker = engine()
        self.images = {name: self._image_id(name) for name in self.confinement.images}
        if not self.memory:
            import psutil
            self.memory = max(256 * 1024**2, int(psutil.virtual_memory().total * 0.9 / self.slots))
        self.reap()
        for image in dict.fromkeys(self.confinement.images):  # before any rule is set: a refused image leaves nothing
            self._probe(image)
        self.egress = Egress(self.tag)
        if self.egress.available:
            self.egress.install()

    def _image_id(self, name: str) -> str:
        import docker
        try:
            return self.docker.images.get(name).id
        except docker.errors.ImageNotFound:
            raise ContainerError(f"--isolation docker: image {name} is not on this machine (docker build --target "
                                 f"gpu-client -t {name} ., or docker pull it)") from None

    def _probe(self, image: str) -> None:
        """The versions and modules of an image as its ranks see them (no network); those of the
        default one are what the agent registers, and every other allowed image must run the
        same Python minor (a job's bundle loads on no other)."""
        probe = ("import json; from zwdx.protocol import runtime_versions; from gpu_client.agent.host import "
                 "importable_modules; from zwdx.protocol.rank import RankSpec; print(json.dumps({'versions': "
                 "runtime_versions(), 'modules': importable_modules(), 'spec': RankSpec.model_json_schema()}))")
        try:
            out = self.docker.containers.run(self.images[image], ["python", "-c", probe], entrypoint=[],
                                             remove=True, network_mode="none", labels={"zwdx.agent": self.tag},
                                             **self._confined(self.uid_base))
            found = json.loads(out.decode().strip().splitlines()[-1])
        except Exception as exc:
            raise ContainerError(f"--isolation docker: image {image} cannot run zwdx ranks: {exc}") from exc
        if found["spec"] != RankSpec.model_json_schema():
            raise ContainerError(f"--isolation docker: image {image} holds another zwdx than this GPU client "
                                 "(rebuild it from this checkout)")
        if self._versions is None:
            self._versions, self._modules = found["versions"], found["modules"]
        elif _minor(found["versions"]) != _minor(self._versions):
            raise ContainerError(f"--isolation docker: image {image} runs Python {found['versions'].get('python')}, "
                                 f"the default image {self.confinement.image} {self._versions.get('python')}: every "
                                 "allowed image must run the same Python minor version")

    def versions(self, agent_versions: dict) -> dict:
        """The image's Python and torch (the scheduler matches jobs to what ranks run)."""
        return self._versions or agent_versions

    def importable(self, agent_modules: list[str] | None) -> list[str] | None:
        return self._modules

    def terms(self) -> dict:
        """The image and limits a rank runs under: registered per slot, kept on each rank's state."""
        c = self.confinement
        return {"image": c.image, "image_id": self.images.get(c.image, "")[:19], "allowed_images": list(c.images),
                "user": f"uid {self.uid_base}+ (not root)", "root_fs": "read-only", "capabilities": "none",
                "no_new_privileges": True, "seccomp": "default", "pids": c.pids, "memory_bytes": self.memory,
                "shm_bytes": c.shm, "work_dir": f"tmpfs {self.rank_dir}, nothing of the host mounted",
                "network": "host, egress only to the server and the job's peers"
                           if self.egress is not None and self.egress.available
                           else "host, egress NOT filtered (iptables rules need root)"}

    def describe(self) -> str:
        t = self.terms()
        return (f"ranks run in containers (isolation: {self.label}; image {t['image']}, allowed "
                f"{', '.join(t['allowed_images'])}; {t['user']}, read-only root, no capabilities, no-new-privileges, "
                f"seccomp default, pids {t['pids']}, memory {t['memory_bytes'] // 1024**2} MiB, {t['work_dir']}; "
                f"network: {t['network']})")

    def _confined(self, uid: int) -> dict:
        c = self.confinement
        return dict(user=f"{uid}:{uid}", read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                    pids_limit=c.pids, mem_limit=self.memory, memswap_limit=self.memory, shm_size=c.shm, init=True,
                    tmpfs={self.rank_dir: f"rw,nosuid,nodev,size={c.work or self.memory},uid={uid},gid={uid},mode=0700",
                           "/tmp": "rw,nosuid,nodev,size=64m,mode=1777"},
                    working_dir=self.rank_dir, ipc_mode="private")

    # -- rank containers ------------------------------------------------------------------------------
    def popen(self, argv: list[str], stdout, env: dict[str, str]) -> RankContainer:
        """A rank container: a standby (``--standby DEVICE`` in ``argv``) is made now, with its
        slot's GPU; a fresh rank's once its spec is written (its GPUs are in it)."""
        env = {k: v for k, v in env.items() if k in PASSED}
        handle = RankContainer(self, env, stdout)
        if "--standby" in argv:
            try:
                handle.create(device=argv[argv.index("--standby") + 1])
            except OSError as exc:  # the slot's rank gets a fresh container, whose failure the submitter reads
                log.warning("no standby container: %s", exc)
        return handle

    def create(self, handle: RankContainer, gpus: list[str], spec: RankSpec | None) -> str:
        """Create the container of ``handle`` (not started): its uid fenced (or let out to the
        job's destinations), its labels, its GPUs."""
        import docker
        image = (spec.image if spec is not None else None) or self.confinement.image
        if image not in self.images:  # the scheduler places no such job here: a donor who changed their mind
            raise ContainerError(f"this GPU client does not run image {image}: its donor allows "
                                 f"{', '.join(self.images)} (zwdx gpu-client --allow-image)")
        handle.image = image
        with self._lock:
            uid = next(self.uid_base + n for n in range(UIDS_PER_AGENT) if self.uid_base + n not in self.live)
            self.live[uid] = handle
        handle.uid = uid
        if self.egress is not None and self.egress.available:
            self.egress.allow(uid, destinations(spec) if spec else [])
        work = self.rank_dir
        env = {**handle.env, "HOME": work, "TMPDIR": work, "USER": "zwdx-rank", "XDG_CACHE_HOME": f"{work}/.cache"}
        if gpus:  # NCCL would take ranks of one host for one machine, and fail to share memory across containers
            env["NCCL_HOSTID"] = f"{socket.gethostname()}-{self.tag}-{uid}"
        command = ["python", "-m", "gpu_client.sandbox.rank_container"]
        if spec is None:
            command += ["--standby", "cuda:0" if gpus else "cpu"]
        host = {k: v for k, v in self._confined(uid).items() if k not in ("user", "working_dir")}
        requests = [docker.types.DeviceRequest(device_ids=gpus, capabilities=[["gpu"]])] if gpus else None
        created = self.docker.api.create_container(
            self.images[image], command, entrypoint=[], stdin_open=True, detach=False, environment=env,
            labels={"zwdx.agent": self.tag, "zwdx.job": spec.job_id if spec else "standby"},
            host_config=self.docker.api.create_host_config(
                auto_remove=True, network_mode="host", log_config={"type": "none", "config": {}},
                extra_hosts=_hosts(self.server), device_requests=requests, **host),
            user=f"{uid}:{uid}", working_dir=self.rank_dir)
        return created["Id"]

    def let_out(self, handle: RankContainer, spec: RankSpec) -> None:
        """A standby took a rank: its uid may reach the job's server and peers now."""
        if self.egress is not None and self.egress.available:
            self.egress.allow(handle.uid, destinations(spec))

    def ended(self, handle: RankContainer) -> None:
        """A container is gone: its uid connects nowhere again, and is free."""
        with self._lock:
            if self.live.get(handle.uid) is handle:
                del self.live[handle.uid]
        if handle.uid is not None and self.egress is not None and self.egress.available:
            try:
                self.egress.fence(handle.uid)
            except Exception:
                log.warning("could not fence uid %d", handle.uid, exc_info=True)

    def takes(self, standby, spec: RankSpec) -> bool:
        """A standby container (the default image) takes only ranks of jobs in that image."""
        return (spec.image or self.confinement.image) == self.confinement.image

    def signal(self, proc, signum: int) -> None:
        proc.kill(signum)

    # -- sandboxes: a directory on the host (``lease``, ``share``, ``release`` as for a process),
    # -- and the same path in the rank's tmpfs, where what was shared is streamed in ---------
    @staticmethod
    def files(box_dir: str) -> list[tuple[str, str]]:
        """(path in the sandbox, host path) of what was shared into it: what its containers are sent."""
        found = []
        for folder, _, names in os.walk(box_dir):
            for name in sorted(names):
                path = os.path.join(folder, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    found.append((os.path.relpath(path, box_dir), path))
        return found

    def shutdown(self) -> None:
        """Stop every container left (the launcher stopped its own), then lift the egress rules."""
        with self._lock:
            left = list(self.live.values())
        threads = [threading.Thread(target=h.stop, args=(3,), daemon=True) for h in left]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for handle in left:
            try:
                handle.wait(30)
            except Exception:
                pass
        if self.egress is not None and self.egress.available:
            self.egress.remove()

    def reap(self) -> None:
        """Remove the containers an earlier run of this agent left (killed before it could)."""
        for left in self.docker.containers.list(all=True, filters={"label": f"zwdx.agent={self.tag}"}):
            log.warning("gpu-client: removing container %s left by an earlier run", left.short_id)
            try:
                left.remove(force=True)
            except Exception:
                pass


def destinations(spec: RankSpec, ports: tuple[int, int] | None = None) -> list[tuple[str, int | tuple[int, int]]]:
    """Where a rank may connect: the server's port, and at each of the job's peers' addresses
    (``spec.peers``: where the server saw them connect from, this client's own, and those its
    reachability probe confirmed) the rendezvous port and the ports gloo's and NCCL's sockets
    listen on (``ports``: the kernel's ephemeral range, ``ephemeral_ports``). The rendezvous
    address counts only as one of those peers' (it is rank 0's client's own word)."""
    url = urlparse(spec.server)
    port = url.port or (443 if url.scheme == "https" else 80)
    allowed: list[tuple[str, int | tuple[int, int]]] = [(a, port) for a in _resolve(url.hostname or "127.0.0.1")]
    collective = ports or ephemeral_ports()
    for peer in dict.fromkeys(spec.peers):
        for addr in _resolve(peer):
            allowed += [(addr, spec.master_port), (addr, collective)]
    return allowed


def ephemeral_ports() -> tuple[int, int]:
    """The ports this machine's kernel binds a socket to when asked for any (gloo's and NCCL's
    listeners, rank 0's rendezvous port): its peers are taken to use the same (Linux's default
    unless changed: 32768-60999)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            first, last = (int(v) for v in fh.read().split())
        return first, last
    except (OSError, ValueError):
        return 32768, 60999


def _minor(versions: dict) -> str:
    return ".".join(str(versions.get("python", "")).split(".")[:2])


def _resolve(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except socket.gaierror:
        return []


def _hosts(server: str | None) -> dict[str, str]:
    """``{name: address}`` of the server when its URL names a host: ranks need no DNS (egress allows none)."""
    name = urlparse(server).hostname if server else None
    if not name:
        return {}
    try:
        ipaddress.ip_address(name)
        return {}
    except ValueError:
        addrs = _resolve(name)
        return {name: addrs[0]} if addrs else {}

