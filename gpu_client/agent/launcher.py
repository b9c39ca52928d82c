"""The rank processes of a GPU client: one standby per slot, started ahead, and the ranks of jobs.

Every rank runs ``python -P -m gpu_client.sandbox.rank_process`` (``isolation.python_argv``: no folder a job
writes on its import path, the working directory included) in its own process group (so a cancel can kill
everything it started, and a crashing job never takes the agent down). It gets its ``RankSpec``
(``zwdx.protocol.rank``) once, as one JSON line on stdin, whether it was a standby waiting for
a job or is started fresh; while the job's bundle is still being fetched a second line,
``ready``, tells it the bundle is on disk.

How a rank process is started and where it runs is the isolation's (``isolation.py``): as a
user of its own per job when the GPU client is root, else as the client's own user, or in a
container of its own (``container.py``, whose handles stand for processes here); each job's
ranks in a private directory (their sandbox, in the spec), which ``release`` removes with
whatever the job left once its ranks are gone.

Only what libraries read themselves is added to a rank's environment (``OMP_NUM_THREADS``,
``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``, ``PYTHONUNBUFFERED``, PyTorch's allocator
setting for pinned memory); the GPU client's secrets (``ZWDX_ROOM_TOKEN`` and the like) are
taken out of the environment it inherits.
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import socket
import subprocess
import threading
import time

from zwdx.protocol.rank import RankSpec, Sandbox
from zwdx.protocol.vocab import Isolation

from gpu_client.sandbox.compile_cache import Lent, RoomCaches
from gpu_client.rank.tuning import DEFAULT_TUNING, Tuning
from gpu_client.sandbox.isolation import ProcessIsolation, private_dir, python_argv, with_import_root

log = logging.getLogger("gpu_client.agent.launcher")

#: Secrets a GPU client may have been given in its environment: never a rank's.
SECRET_VARIABLES = ("ZWDX_ROOM_TOKEN", "ZWDX_ROOM_TOKEN_FILE", "ZWDX_JOB_KEY")


class RunningJob:
    """The rank processes of one attempt of one job on this GPU client, and their sandbox."""

    def __init__(self, job_id: str, attempt: int):
        self.job_id, self.attempt = job_id, attempt
        self.key = f"{job_id}:{attempt}"
        self.procs: dict[int, subprocess.Popen] = {}
        self.sandbox: Sandbox | None = None
        self.compile_cache: Lent | None = None  # its room's, lent to it (``--compile-cache``)


#: Threads that touch the pages of pinned host memory before the CUDA driver registers it.
PINNING_THREADS = 8


def rank_environ(threads: int, network: dict[str, str], tuning: Tuning = DEFAULT_TUNING) -> dict[str, str]:
    """A rank process's environment: this one's, without its secrets, with what libraries read
    and the GPU client's switches (``tuning``)."""
    env = {k: v for k, v in os.environ.items() if k not in SECRET_VARIABLES}
    env.update({"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **network, **tuning.environ()})
    env = with_import_root(env)
    env.update(pinning_environ(env))
    return env


def pinning_environ(env: dict[str, str]) -> dict[str, str]:
    """PyTorch's allocator setting with pinned host memory registered, not allocated by the
    driver: ``pinned_use_cuda_host_register`` and ``pinned_num_register_threads`` added to the
    setting the rank would have (``PYTORCH_ALLOC_CONF``, which PyTorch reads first, else
    ``PYTORCH_CUDA_ALLOC_CONF``), unless it names them. A checkpoint's first host buffers are
    pinned in the background while training goes on (``staging.py``): allocated by the driver,
    1.4 GiB held every CUDA call of the training thread for 2.2 s (15 GiB: 13 s); registered,
    once threads have touched the pages, 0.003 s (``bench/pinning.py``)."""
    name = "PYTORCH_ALLOC_CONF" if env.get("PYTORCH_ALLOC_CONF") else "PYTORCH_CUDA_ALLOC_CONF"
    parts = [p.strip() for p in env.get(name, "").split(",") if p.strip()]
    keys = {p.split(":", 1)[0].strip() for p in parts}
    if keys & {"pinned_use_cuda_host_register", "pinned_num_register_threads"}:
        return {}
    threads = max(1, min(PINNING_THREADS, os.cpu_count() or 1))
    parts += ["pinned_use_cuda_host_register:True", f"pinned_num_register_threads:{threads}"]
    return {name: ",".join(parts)}


class Launcher:
    """Starts, hands out and stops rank processes. ``network``: the socket interface variables
    for gloo and NCCL (set once the agent knows which interface reaches the server)."""

    def __init__(self, work_dir: str, isolation: ProcessIsolation, standby: bool = True,
                 compile_cache: RoomCaches | None = None, tuning: Tuning = DEFAULT_TUNING):
        self.work_dir = work_dir
        self.tuning = tuning  # the switches its ranks get (rank_environ)
        self.isolation = isolation
        self.use_standby = standby
        #: ``--compile-cache``: the rooms' compile caches (not for containers, which see no host folder)
        self.compile_cache = compile_cache if isolation.kind != Isolation.DOCKER else None
        self.room_id: str | None = None  # the room this GPU client serves, once registered
        self.network: dict[str, str] = {}
        self.standby: dict[int, subprocess.Popen] = {}  # slot index -> rank process waiting for a job
        self._lock = threading.Lock()
        self._wanted: queue.Queue[tuple[int, str, int]] = queue.Queue()
        self.stopping = threading.Event()

    # -- standby processes -------------------------------------------------------------------------
    def want_standby(self, index: int, device: str, threads: int) -> None:
        """Have the next rank process of a slot started ahead of time (see ``runner.standby``), by
        the thread that calls ``start_wanted``: a rank dies with the thread that started it
        (PR_SET_PDEATHSIG is a thread's, not a process's), so a standby started by a short-lived
        thread could be killed when that thread ended."""
        if self.use_standby and not self.stopping.is_set():
            self._wanted.put((index, device, threads))

    def start_wanted(self, timeout: float) -> None:
        """Start the standby processes asked for (the agent's main thread calls it in a loop)."""
        try:
            index, device, threads = self._wanted.get(timeout=timeout)
        except queue.Empty:
            return
        if self.stopping.is_set():
            return
        with self._lock:
            if index in self.standby and self.standby[index].poll() is None:
                return
            folder = private_dir(os.path.join(self.work_dir, "standby"))
            with open(os.path.join(folder, f"slot{index}.log"), "ab") as out:
                self.standby[index] = self.isolation.popen(
                    python_argv("gpu_client.sandbox.rank_process", "--standby", device), out,
                    rank_environ(threads, self.network, self.tuning))

    # -- ranks ---------------------------------------------------------------------------------------
    def start(self, index: int, spec: RankSpec, client_id: str = "", listeners: tuple = ()) -> subprocess.Popen:
        """Hand the rank to slot ``index``'s standby process, or start a fresh one; either gets
        ``spec`` as its first line on stdin, then ``listeners`` (as many as ``spec.listeners``
        counts: the sockets of the stores it serves) on its channel. The agent's copies of them
        are closed either way."""
        try:
            proc = self._start(index, spec, client_id)
            channel = getattr(proc, "channel", None)
            if channel is not None:
                try:
                    if spec.listeners:
                        socket.send_fds(channel, [b"L"], [s.fileno() for s in listeners[:spec.listeners]])
                except OSError:
                    pass  # it died at once; its exit code says so
                finally:
                    channel.close()
                    proc.channel = None
            return proc
        finally:
            for held in listeners:
                held.close()

    def _start(self, index: int, spec: RankSpec, client_id: str) -> subprocess.Popen:
        with self._lock:
            proc = self.standby.pop(index, None)
        if proc is not None and (spec.script is not None or not self.isolation.takes(proc, spec)):
            # a script runs in a child of its own: a standby's torch and CUDA context would only
            # hold memory meanwhile; a job in another image than the standby container's needs its own
            self.isolation.signal(proc, signal.SIGKILL)
            proc.wait()
            if getattr(proc, "channel", None) is not None:
                proc.channel.close()
            proc = None
        if proc is not None and proc.poll() is None:
            try:
                proc.stdin.write(spec.line())
                proc.stdin.flush()
                return proc
            except OSError:
                proc.kill()
        if self.use_standby and spec.script is None:
            log.info("gpu-client %s: no standby rank process on slot %d; starting a fresh one", client_id, index)
        with open(spec.log_path, "ab") as out:
            proc = self.isolation.popen(python_argv("gpu_client.sandbox.rank_process"), out,
                                        rank_environ(spec.threads, self.network, self.tuning))
        try:
            proc.stdin.write(spec.line())
            proc.stdin.flush()
        except OSError:
            pass  # it died at once; its exit code says so
        return proc

    @staticmethod
    def ready(job: RunningJob, pending: bool) -> None:
        """The bundle is on disk: tell the ranks that wait for it, and close their stdin."""
        for proc in job.procs.values():
            try:
                if pending:
                    proc.stdin.write(b"ready\n")
                proc.stdin.close()
            except OSError:
                pass  # the rank is gone already; its exit code says so

    def kill(self, job: RunningJob, grace: float = 3.0) -> None:
        """SIGTERM every rank's process group, SIGKILL what is left after ``grace`` seconds."""
        for proc in list(job.procs.values()):
            if proc.poll() is None:
                self.isolation.signal(proc, signal.SIGTERM)
        deadline = time.time() + grace
        for proc in list(job.procs.values()):
            try:
                proc.wait(timeout=max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                self.isolation.signal(proc, signal.SIGKILL)

    # -- sandboxes -----------------------------------------------------------------------------------
    def lease(self, job: RunningJob, client_id: str) -> Sandbox:
        """The job's sandbox on this GPU client (its ranks' directory, and their user)."""
        job.sandbox = self.isolation.lease(client_id, job.job_id, job.attempt)
        if self.compile_cache is not None and self.room_id:
            try:
                job.compile_cache = self.compile_cache.lend(self.room_id, job.sandbox.uid)
            except OSError:  # the job compiles in its sandbox: slower, not wrong
                log.exception("job %s: its room's compile cache could not be lent", job.job_id)
            if job.compile_cache is None:
                log.info("job %s: it compiles in its sandbox (its room's compile cache is another job's, or "
                         "could not be lent)", job.job_id)
            else:
                job.sandbox = job.sandbox.model_copy(update={"compile_cache": job.compile_cache.path})
        return job.sandbox

    def release(self, job: RunningJob) -> None:
        """The job's ranks are gone: end what is left of it and remove its sandbox."""
        lent, job.compile_cache = job.compile_cache, None
        if lent is not None:  # shut to the job's user before its uid can serve another job
            try:
                self.compile_cache.shut(lent)
            except OSError:
                log.exception("job %s: its room's compile cache %s could not be shut", job.job_id, lent.path)
        if job.sandbox is not None:
            try:
                self.isolation.release(job.sandbox)
            except Exception:
                log.exception("job %s: its sandbox %s could not be released", job.job_id, job.sandbox.dir)
            job.sandbox = None
        if lent is not None:
            try:
                self.compile_cache.give_back(lent)
            except Exception:
                log.exception("job %s: its room's compile cache %s could not be given back", job.job_id, lent.path)

    def shutdown(self) -> None:
        """Kill the standby processes; start no more."""
        self.stopping.set()
        with self._lock:
            for proc in self.standby.values():
                self.isolation.signal(proc, signal.SIGKILL)
                proc.wait()
            self.standby.clear()
        self.isolation.shutdown()
