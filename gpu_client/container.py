"""Rank processes in containers (``zwdx gpu-client --isolation docker``): each rank of a job runs in
a fresh container, started through the Docker SDK and confined as a donor who runs strangers'
code would want (``Confinement``):

- an image the donor allows (``--allow-image``, the first one the default: the agent's own);
- the rank's GPU only (a device request for its index; inside, it is ``cuda:0``), or no GPU;
- a non-root uid of its own per slot, a read-only root filesystem, every capability dropped,
  no-new-privileges, Docker's default seccomp profile, an init as pid 1;
- pids and memory limits (no swap), a bounded /dev/shm;
- a private tmpfs work dir, ``/work`` (home, TMPDIR: the job's bundle and checkpoints), and
  nothing of the host mounted; of the agent's environment only what libraries read;
- the host's network (peers elsewhere reach its rendezvous and collective ports), egress
  limited to the server and the job's peers where the agent may set iptables rules (egress.py).

The agent and a container speak over one attached stream (rank_container.py: the spec, then
the bundle in; the output out); when the stream ends while the rank runs, the agent is gone and
the container ends itself, and Docker removes it (``auto_remove``). Containers left by an
agent killed before it could stop them are removed when the agent of that work dir starts
again (``reap``). Standby containers (torch imported) wait per slot, as standby processes do.

    launcher = ContainerLauncher(work_dir, confinement=Confinement(images=["zwdx-gpu-client"]))
    launcher.runtime()      -> (versions, modules) of the image: what the agent registers
    launcher.describe()     -> the isolation in force, for the donor and the dashboard
    launcher.start(slot, spec) -> RankContainer (the agent treats it as a rank process)
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import os
import queue
import socket
import threading
from dataclasses import dataclass, field
from urllib.parse import urlparse

from zwdx.protocol.rank import RankSpec

from .egress import Egress
from .rank_container import WORK, RankContainer, report_unstarted

log = logging.getLogger("gpu_client.container")

#: The image a donor's agent runs ranks in unless told otherwise (run_gpu_client.sh builds it).
DEFAULT_IMAGE = "zwdx-gpu-client"
#: Variables of the agent's environment a rank container gets (what libraries read themselves).
PASSED = ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "ZWDX_STANDBY_WARMUP", "NCCL_DEBUG")


class ContainerError(RuntimeError):
    """The Docker engine or an image cannot do what the isolation needs (the message says why)."""


class ImageDenied(ContainerError):
    """A job asked for an image this GPU client's donor does not allow."""


@dataclass
class Confinement:
    """What a rank container may use. Sizes in bytes. ``uid_base`` + slot index is a slot's uid
    (None: one of the agent's own, from its work dir, so that two agents of a host differ)."""
    images: list[str] = field(default_factory=lambda: [DEFAULT_IMAGE])
    memory: int | None = None      # None: the host's RAM shared out over the slots
    pids: int = 4096
    shm: int = 2 * 1024**3
    work: int | None = None        # tmpfs size of /work; None: as much as memory
    uid_base: int | None = None

    @property
    def image(self) -> str:
        return self.images[0]


def engine():
    """A Docker SDK client of an answering engine, or ContainerError saying why there is none."""
    import docker
    try:
        client = docker.from_env(timeout=30)
        client.ping()
        return client
    except Exception as exc:
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        raise ContainerError(f"no Docker engine answers ({where}: {exc})") from exc


def default_isolation(images: list[str] | None = None) -> tuple[str, str]:
    """``zwdx gpu-client --isolation auto``: docker when it can be, else process; and why."""
    image = (images or [DEFAULT_IMAGE])[0]
    if in_container():
        return "process", "this GPU client runs in a container itself"
    try:
        client = engine()
    except ContainerError as err:
        return "process", str(err)
    try:
        client.images.get(image)
    except Exception:
        return "process", f"image {image} is not on this machine (docker build --target gpu-client -t {image} .)"
    finally:
        client.close()
    return "docker", "a Docker engine answers and image " + image + " is here"


def agent_tag(work_dir: str) -> str:
    """The label value of an agent's containers (``zwdx.agent``), and its iptables chains' tag:
    one per work dir, so that the agent started again there finds what an earlier run left."""
    return hashlib.sha256(os.path.abspath(work_dir).encode()).hexdigest()[:10]


def in_container() -> bool:
    """Whether this process itself runs in a container (then ranks run as processes by default)."""
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")


class ContainerLauncher:
    """``launcher.Launcher``'s part for rank containers: standby per slot, start, ready, kill,
    shutdown. ``runtime()`` says what the image runs (the agent registers that, not its own)."""

    def __init__(self, work_dir: str, standby: bool = True, confinement: Confinement | None = None,
                 slots: int = 1, server: str | None = None, client=None):
        self.work_dir, self.use_standby = work_dir, standby
        self.hosts = _hosts(server)  # the server's name -> address: ranks need no DNS (egress allows none)
        self.confinement = confinement or Confinement()
        self.docker = client or engine()
        self.tag = agent_tag(work_dir)
        #: The uid of slot 0's containers; slot i's is this + i. Far above any login's.
        self.uid_base = self.confinement.uid_base or 2_000_000 + int(self.tag, 16) % 8000 * 256
        self.network: dict[str, str] = {}
        self.standby: dict[int, RankContainer] = {}
        self.active: dict[str, tuple[int, RankContainer]] = {}  # container id -> (slot, container)
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._wanted: queue.Queue[tuple[int, str, int]] = queue.Queue()
        self.images = {name: self._image_id(name) for name in self.confinement.images}
        total = _ram()
        self.memory = self.confinement.memory or max(256 * 1024**2, int(total * 0.9 / max(1, slots)))
        self.reap()
        self._runtime = self._probe()  # before any rule is set: a refused image leaves nothing behind
        self.egress = Egress(self.tag)
        if self.egress.available:
            self.egress.install()

    # -- what runs, and under which limits -----------------------------------------------------
    def _image_id(self, name: str) -> str:
        import docker
        try:
            return self.docker.images.get(name).id
        except docker.errors.ImageNotFound:
            raise ContainerError(f"image {name} is not on this machine (docker build --target gpu-client -t {name} ., "
                                 "or docker pull it)") from None

    def runtime(self) -> tuple[dict, list[str] | None]:
        """The versions and importable modules of the default image, as its ranks see them."""
        return self._runtime

    def _probe(self) -> tuple[dict, list[str] | None]:
        """``runtime()``, asked of the image in a container like a rank's (no network); a
        ContainerError when the image cannot run a rank of this agent (no zwdx, another zwdx)."""
        probe = ("import json; from zwdx.protocol import runtime_versions; from gpu_client.host import "
                 "importable_modules; from zwdx.protocol.rank import RankSpec; print(json.dumps({'versions': "
                 "runtime_versions(), 'modules': importable_modules(), 'spec': RankSpec.model_json_schema()}))")
        try:
            out = self.docker.containers.run(self.images[self.confinement.image], ["python", "-c", probe],
                                             entrypoint=[], remove=True, network_mode="none",
                                             **self._confined(self.uid_base))
            found = json.loads(out.decode().strip().splitlines()[-1])
        except Exception as exc:
            raise ContainerError(f"image {self.confinement.image} cannot run zwdx ranks: {exc}") from exc
        if found["spec"] != RankSpec.model_json_schema():
            raise ContainerError(f"image {self.confinement.image} holds another zwdx than this GPU client "
                                 "(rebuild it from this checkout)")
        return found["versions"], found["modules"]

    def describe(self) -> dict:
        """The isolation in force, for the donor (printed at start) and the dashboard."""
        c = self.confinement
        return {"isolation": "docker", "image": c.image, "image_id": self.images[c.image][:19],
                "allowed_images": list(c.images), "user": f"uid {self.uid_base}+slot (not root)",
                "root_fs": "read-only", "capabilities": "none", "no_new_privileges": True, "seccomp": "default",
                "pids": c.pids, "memory_bytes": self.memory, "shm_bytes": c.shm,
                "work_dir": "tmpfs /work (bundle, checkpoints), nothing of the host mounted",
                "network": "host, egress only to the server and the job's peers" if self.egress.available
                           else "host, egress NOT filtered (iptables rules need root)"}

    def _confined(self, uid: int) -> dict:
        c = self.confinement
        return dict(user=f"{uid}:{uid}", read_only=True, cap_drop=["ALL"], security_opt=["no-new-privileges"],
                    pids_limit=c.pids, mem_limit=self.memory, memswap_limit=self.memory, shm_size=c.shm, init=True,
                    tmpfs={WORK: f"rw,nosuid,nodev,size={c.work or self.memory},uid={uid},gid={uid},mode=0700",
                           "/tmp": "rw,nosuid,nodev,size=64m,mode=1777"},
                    working_dir=WORK, ipc_mode="private", labels={"zwdx.agent": self.tag})

    def _create(self, index: int, device: str, threads: int, log_path: str, spec: RankSpec | None = None,
                standby: bool = False) -> RankContainer:
        import docker
        uid, gpu = self.uid_base + index, device.startswith("cuda")
        env = {k: v for k, v in {**os.environ, **self.network}.items() if k in PASSED}
        env.update({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", "HOME": WORK, "TMPDIR": WORK,
                    "USER": "zwdx-rank", "XDG_CACHE_HOME": f"{WORK}/.cache"})
        if gpu:  # NCCL would take ranks of one host for one machine, and fail to share memory across containers
            env["NCCL_HOSTID"] = f"{socket.gethostname()}-{self.tag}-{index}"
        command = ["python", "-m", "gpu_client.rank_container", *(["--standby", "cuda:0" if gpu else "cpu"]
                                                                 if standby else [])]
        host = {k: v for k, v in self._confined(uid).items() if k not in ("user", "labels", "working_dir")}
        requests = None
        if gpu:  # the slot's GPU, and no other
            requests = [docker.types.DeviceRequest(device_ids=[device.split(":")[1]], capabilities=[["gpu"]])]
        created = self.docker.api.create_container(
            self.images[self.confinement.image], command, entrypoint=[], stdin_open=True, detach=False, environment=env,
            labels={"zwdx.agent": self.tag, "zwdx.slot": str(index), "zwdx.job": spec.job_id if spec else "standby"},
            host_config=self.docker.api.create_host_config(
                auto_remove=True, network_mode="host", log_config={"type": "none", "config": {}},
                extra_hosts=self.hosts, device_requests=requests, **host),
            user=f"{uid}:{uid}", working_dir=WORK)
        try:
            handle = RankContainer(self.docker.api, created["Id"], log_path, report=report_unstarted,
                                   on_end=self._ended)
            with self._lock:
                self.active[handle.id] = (index, handle)
            handle.start()
        except Exception:
            self.docker.api.remove_container(created["Id"], force=True)  # created, never started: not auto-removed
            raise
        return handle

    def _ended(self, handle: RankContainer) -> None:
        """A container is gone: if it held a rank, its slot's uid may connect nowhere again."""
        with self._lock:
            index, _ = self.active.pop(handle.id, (None, None))
        if index is not None and handle.spec is not None and self.egress.available:
            self.egress.fence(self.uid_base + index)

    # -- standby containers ---------------------------------------------------------------------
    def want_standby(self, index: int, device: str, threads: int) -> None:
        if self.use_standby and not self.stopping.is_set():
            self._wanted.put((index, device, threads))

    def start_wanted(self, timeout: float) -> None:
        try:
            index, device, threads = self._wanted.get(timeout=timeout)
        except queue.Empty:
            return
        if self.stopping.is_set():
            return
        with self._lock:
            if index in self.standby and self.standby[index].poll() is None:
                return
        folder = os.path.join(self.work_dir, "standby")
        os.makedirs(folder, exist_ok=True)
        try:
            if self.egress.available:
                self.egress.fence(self.uid_base + index)
            handle = self._create(index, device, threads, os.path.join(folder, f"slot{index}.log"), standby=True)
        except Exception as exc:
            log.warning("gpu-client: no standby container for slot %d: %s", index, exc)
            return
        with self._lock:
            self.standby[index] = handle

    # -- ranks -----------------------------------------------------------------------------------
    def start(self, index: int, spec: RankSpec, client_id: str = "", image: str | None = None) -> RankContainer:
        """Slot ``index``'s standby container takes the rank, or a fresh one does; either gets
        ``spec``. ``image``: the one the job asks for (None: the default), if its donor allows it."""
        if image is not None and image not in self.images:
            raise ImageDenied(f"{spec.where} does not run image {image}: its donor allows "
                              f"{', '.join(self.images)} (zwdx gpu-client --allow-image)")
        try:
            if self.egress.available:
                self.egress.allow(self.uid_base + index, destinations(spec))
            with self._lock:
                handle = self.standby.pop(index, None)
            if handle is None or handle.poll() is not None:
                if self.use_standby:
                    log.info("gpu-client %s: no standby container on slot %d; starting a fresh one", client_id, index)
                handle = self._create(index, spec.device, spec.threads, spec.log_path, spec)
            else:
                handle.log_to(spec.log_path)
        except Exception as exc:  # the engine went away, a rule could not be set: the submitter reads which
            raise ContainerError(f"{spec.where} could not start the rank's container: {exc}") from exc
        handle.spec = spec
        try:
            handle.send(spec.line())
        except OSError:
            pass  # it died at once; its exit code says so
        return handle

    def ready(self, job, pending: bool) -> None:
        """The bundle is on disk: stream it to each rank's container (all at once)."""
        def send(handle: RankContainer):
            try:
                handle.send_bundle(str(handle.spec.bundle_path))
            except OSError:
                pass  # the container is gone; its exit code says so
        threads = [threading.Thread(target=send, args=(h,), daemon=True) for h in job.procs.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def kill(self, job, grace: float = 3.0) -> None:
        threads = [threading.Thread(target=h.stop, args=(grace,), daemon=True) for h in list(job.procs.values())]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def shutdown(self) -> None:
        """Stop every container of this agent (standby and ranks), then lift its egress rules."""
        self.stopping.set()
        with self._lock:
            every, self.standby = [h for _, h in self.active.values()], {}
        threads = [threading.Thread(target=h.stop, args=(3,), daemon=True) for h in every]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for handle in every:
            try:
                handle.wait(30)
            except Exception:
                pass
        if self.egress.available:
            self.egress.remove()

    def reap(self) -> None:
        """Remove the containers an earlier run of this agent left (killed before it could)."""
        for left in self.docker.containers.list(all=True, filters={"label": f"zwdx.agent={self.tag}"}):
            log.warning("gpu-client: removing container %s left by an earlier run", left.short_id)
            try:
                left.remove(force=True)
            except Exception:
                pass


def destinations(spec: RankSpec) -> list[tuple[str, int | None]]:
    """Where a rank may connect: the server's port, and every port of the job's peers."""
    url = urlparse(spec.server)
    port = url.port or (443 if url.scheme == "https" else 80)
    allowed = [(addr, port) for addr in _resolve(url.hostname or "127.0.0.1")]
    for peer in dict.fromkeys([*spec.peers, spec.master_addr]):
        allowed += [(addr, None) for addr in _resolve(peer)]
    return allowed


def _resolve(host: str) -> list[str]:
    try:
        return sorted({info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)})
    except socket.gaierror:
        return []


def _hosts(server: str | None) -> dict[str, str]:
    """``{name: address}`` of the server when its URL names a host (not an address)."""
    name = urlparse(server).hostname if server else None
    if not name:
        return {}
    try:
        ipaddress.ip_address(name)
        return {}  # an address already
    except ValueError:
        addrs = _resolve(name)
        return {name: addrs[0]} if addrs else {}


def _ram() -> int:
    import psutil
    return psutil.virtual_memory().total
