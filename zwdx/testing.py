"""zwdx's processes as children of a test or a benchmark: a server, GPU clients, a MongoDB
wire-protocol server, each its own OS process on 127.0.0.1 and a free port, started and
stopped by pid (never by name). The test suite (test/procs.py) and the benchmarks
(bench/harness.py) both build on this module.

    free_port() -> int                      a port held for this process: a restart may reuse it
    wait_until(predicate, timeout, what=...)
    Child(args, log_path, env)              any command: own session, output in a log file
    ServerProc(data_dir, ...)               ``python -m zwdx.cli server``, waited for until healthy
    GpuClientProc(server_url, token, ...)   ``python -m zwdx.cli gpu-client`` (the token in its environment)
    MongoProc(log_dir)                      nx-27017, in memory
    RedisProc(log_dir)                      redis-server, in memory (Socket.IO's message queue)
    BalancerProc(log_dir, server_urls)      HAProxy in front of several servers (``url``)

A child starts in its own session (so its process group is everything it started that did not
leave it), in the directory that holds the zwdx package this process imported (so it runs the
same zwdx), and without this process's ``ZWDX_*`` variables (a developer's ``ZWDX_MONGO_URI``
must not move a test's server to MongoDB) except ``ZWDX_CONFIG_DIR`` and those passed in
``env``. ``stop()`` ends the whole group: SIGTERM, then after a grace period SIGKILL, which
is sent in any case to whatever of the group is left after its leader exited.

Ports: ``free_port()`` picks one below the kernel's ephemeral range (so no outgoing connection
is ever given it) and locks it for this process's life in a file every zwdx test process on
the machine shares (so no other one picks it). A server killed and started again on its port
therefore finds it free: the port stays held while no process listens on it.
"""
from __future__ import annotations

import fcntl
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

#: The directory holding the zwdx package this process imported (a checkout's root, or
#: site-packages): children run there, so ``python -m zwdx.cli`` is this same zwdx.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: ``ZWDX_*`` variables children get from this process: where the SDK keeps credentials (a
#: test points it at a temporary directory so that nothing writes the real home).
INHERITED = ("ZWDX_CONFIG_DIR",)


#: The file whose bytes lock ports (byte N: port N), shared by every process on the machine
#: that uses this module. POSIX record locks: held while the process lives, gone when it exits.
PORT_LOCKS = os.path.join(tempfile.gettempdir(), "zwdx-test-ports.lock")
_held: set[int] = set()
_random = random.SystemRandom()  # not the random module: a seeded test must not make every process pick alike
_locks_fd: int | None = None


def _port_range() -> range:
    """Ports free_port() picks from: below the kernel's ephemeral range, where connect() and
    bind(0) never go, or above it where the range starts too low to leave room below."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            low, high = (int(v) for v in fh.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999  # Linux's default
    return range(10000, low) if low - 10000 >= 4096 else range(high + 1, 65536)


def _lock(port: int) -> bool:
    global _locks_fd
    if _locks_fd is None:
        try:
            _locks_fd = os.open(PORT_LOCKS, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                os.fchmod(_locks_fd, 0o666)  # every user's test runs share it (the umask took bits away)
            except OSError:
                pass  # another user's file: theirs to set
        except PermissionError:  # another user's file that we may not write: a file of our own
            _locks_fd = os.open(f"{PORT_LOCKS}.{os.getuid()}", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.lockf(_locks_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port)
        return True
    except OSError:
        return False  # another process holds it


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no obstacle
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False


def free_port() -> int:
    """A TCP port nothing listens on, held by this process until it exits: a server of this
    process may be stopped and started on it again without another process taking it meanwhile
    (see the module's docstring)."""
    ports = _port_range()
    for _ in range(200):
        port = _random.choice(ports)
        if port not in _held and _lock(port):
            if _bindable(port):
                _held.add(port)
                return port
            fcntl.lockf(_locks_fd, fcntl.LOCK_UN, 1, port)
    raise RuntimeError(f"no free port found in {ports.start}-{ports.stop - 1}")


def holds(port: int) -> bool:
    """Whether ``port`` came from this process's free_port() (and so is still held)."""
    return port in _held


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1, what: str = "condition"):
    """The first truthy value of ``predicate()``, asked every ``interval`` seconds; TimeoutError
    naming ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")


def child_env(env: dict | None = None) -> dict:
    """This process's environment without its ``ZWDX_*`` variables (but ``INHERITED``), with
    unbuffered Python output and ``env`` on top."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("ZWDX_") or k in INHERITED}
    return {**base, "PYTHONUNBUFFERED": "1", **(env or {})}


class Child:
    """A child process in its own session with its output in a log file."""

    def __init__(self, args: list[str], log_path: str, env: dict | None = None, cwd: str = PACKAGE_PARENT):
        self.args, self.log_path = args, log_path
        self.started_at = time.time()
        with open(log_path, "ab") as log:
            self.popen = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=child_env(env),
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def kill(self, sig=signal.SIGKILL) -> None:
        """Send ``sig`` to the process alone (not its group): a crash, as a test stages one."""
        if self.alive():
            os.kill(self.popen.pid, sig)

    def _signal_group(self, sig) -> None:
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone

    def stop(self, grace: float = 15.0) -> int | None:
        """End the process and its group: SIGTERM, SIGKILL after ``grace`` seconds, and SIGKILL
        to what is left of the group once the process exited. Returns its exit status."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(grace)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        self.popen.wait()
        return self.popen.returncode

    @staticmethod
    def stop_all(procs, grace: float = 15.0) -> None:
        """``stop`` each of ``procs``, all at once: each is told (SIGTERM) before any is waited
        for, so their shutdowns overlap (a GPU client takes seconds to stop its ranks)."""
        procs = list(procs)
        for proc in procs:
            if proc.alive():
                proc._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            try:
                proc.popen.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
            proc._signal_group(signal.SIGKILL)
            proc.popen.wait()

    def output(self) -> str:
        """Everything the process wrote so far."""
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read().decode(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-n:])


class ServerProc(Child):
    """``python -m zwdx.cli server`` on ``host`` and a free port (``url``); ``extra`` adds
    arguments, ``mongo_uri`` picks the MongoDB store. Returns once ``/health`` answers."""

    def __init__(self, data_dir: str, port: int | None = None, extra: list[str] | None = None,
                 env: dict | None = None, host: str = "127.0.0.1", cwd: str = PACKAGE_PARENT,
                 mongo_uri: str | None = None, timeout: float = 60.0):
        if port is not None and not holds(port):
            # a port freed by a stopped server may be taken by anyone before the new one binds it
            raise ValueError(f"port {port} is not held by this process: restart a server only on a port "
                             "from free_port()")
        self.port = port or free_port()
        self.host = host
        self.url = f"http://{host}:{self.port}"
        self.data_dir = data_dir
        os.makedirs(data_dir, exist_ok=True)
        args = [sys.executable, "-m", "zwdx.cli", "server", "--host", host, "--port", str(self.port),
                "--data-dir", data_dir, *(extra or [])]
        if mongo_uri:
            args += ["--mongo-uri", mongo_uri]
        super().__init__(args, os.path.join(data_dir, f"server-{self.port}.log"), env, cwd)
        try:
            wait_until(self.healthy, timeout, what=f"the zwdx server on {self.url}\n{self.output()}")
        except BaseException:  # not up in time: no caller holds it to stop it, so stop it here
            self.stop()
            raise

    def healthy(self) -> bool:
        import requests
        if not self.alive():
            raise RuntimeError(f"zwdx server exited:\n{self.output()}")
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False


class GpuClientProc(Child):
    """``python -m zwdx.cli gpu-client`` in the room of ``token``: one CPU slot (``gpu=None``)
    or the GPUs listed (``gpu=0``, ``gpu="0,1"``); ``extra`` adds arguments. The token travels in
    its environment (``ZWDX_ROOM_TOKEN``), never on its command line, which every user of the
    machine can read (None: the caller gives it otherwise, ``--room-token-file`` in ``extra``).
    ``cwd``: the checkout whose zwdx it runs (and its ranks: they start there too)."""

    def __init__(self, server_url: str, token: str | None, work_dir: str, client_id: str, gpu: int | str | None = None,
                 threads: int = 1, extra: list[str] | None = None, env: dict | None = None,
                 cwd: str = PACKAGE_PARENT):
        os.makedirs(work_dir, exist_ok=True)
        self.client_id = client_id
        slots = ["--gpus", str(gpu)] if gpu is not None else ["--cpu"]
        super().__init__([sys.executable, "-m", "zwdx.cli", "gpu-client", "--server", server_url,
                          *slots, "--threads", str(threads), "--client-id", client_id,
                          "--work-dir", work_dir, *(extra or [])], os.path.join(work_dir, "gpu-client.log"),
                         {**({"ZWDX_ROOM_TOKEN": token} if token is not None else {}), **(env or {})}, cwd)


class MongoProc(Child):
    """A MongoDB wire-protocol server in memory (``nx-27017``) for the MongoDB store (``uri``)."""

    def __init__(self, log_dir: str, database: str = "zwdx"):
        if importlib.util.find_spec("nx_27017") is None:
            raise RuntimeError("nx-27017 is not installed (pip install nx-27017)")
        self.port = free_port()
        self.uri = f"mongodb://127.0.0.1:{self.port}/{database}"
        # as a module, so that it runs from a --target install with no script on PATH
        super().__init__([sys.executable, "-m", "nx_27017.nx_27017", "--db", "memory", "-p", str(self.port)],
                         os.path.join(log_dir, "mongo.log"))
        wait_until(self._up, 30, what=f"nx-27017 on port {self.port}")

    def _up(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"nx-27017 exited:\n{self.tail()}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0


class RedisProc(Child):
    """``redis-server`` (Debian's redis-server), in memory only, for Socket.IO's message queue
    (``url``); ``port`` to start it again where it was."""

    def __init__(self, log_dir: str, port: int | None = None):
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        super().__init__(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], os.path.join(log_dir, f"redis-{self.port}.log"))
        wait_until(self._up, 30, what=f"redis-server on port {self.port}")

    def _up(self) -> bool:
        if not self.alive():
            raise RuntimeError(f"redis-server exited:\n{self.tail()}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", self.port)) == 0


#: HAProxy in front of zwdx servers (the compose file's scale profile has the same): each new
#: connection to the server with the fewest (websockets spread evenly), a websocket kept on its
#: server, a Socket.IO long-polling session kept on its server by a cookie; a server that stops
#: answering /health is out within two seconds, and a connection it refuses is tried on another.
HAPROXY_CFG = """global
    # maxconn: from the open-files limit HAProxy finds
defaults
    mode http
    option forwardfor
    option redispatch
    retries 3
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    timeout tunnel 1h
frontend zwdx
    bind 127.0.0.1:{port}
    default_backend servers
backend servers
    balance leastconn
    option httpchk GET /health
    cookie ZWDX_SERVER insert indirect nocache
{servers}
"""


class BalancerProc(Child):
    """HAProxy (Debian's haproxy) on a free port (``url``) in front of ``server_urls``."""

    def __init__(self, log_dir: str, server_urls: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        servers = "\n".join(f"    server s{i} {url.split('://', 1)[1]} check inter 1s fall 2 rise 1 cookie s{i}"
                            for i, url in enumerate(server_urls))
        config = os.path.join(log_dir, f"haproxy-{self.port}.cfg")
        with open(config, "w") as fh:
            fh.write(HAPROXY_CFG.format(port=self.port, servers=servers))
        super().__init__(["haproxy", "-db", "-f", config], os.path.join(log_dir, f"haproxy-{self.port}.log"))
        wait_until(self._up, 30, what=f"haproxy on port {self.port}")

    def _up(self) -> bool:
        import requests
        if not self.alive():
            raise RuntimeError(f"haproxy exited:\n{self.tail()}")
        try:
            return requests.get(f"{self.url}/health", timeout=1).status_code == 200
        except requests.RequestException:
            return False
