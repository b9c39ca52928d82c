"""How a GPU client keeps job code away from itself and from other jobs: the isolation of its
rank processes. The launcher asks this module how to start a rank process, and the agent asks
it for each job's sandbox.

    iso = kinds.build("user", work_dir, rank_dir=None, uids=None)  # zwdx gpu-client --isolation user
    iso = kinds.build("docker", work_dir, confinement=..., server=url, slots=n)  # --isolation docker
    iso.check()                       at the agent's start: IsolationError saying what to change
    iso.kind, iso.label               what the agent registers per slot, and says at its start
    iso.importable(modules)           the modules a rank can import (a per-job user: asked as one)
    iso.popen(argv, stdout, env)      start a rank process (a standby, or a fresh rank)
    box = iso.lease(client_id, job_id, attempt)   the sandbox of one attempt of a job here
    iso.share(bundle_path, box)       the job's bundle, where its ranks read it (box.dir/bundle.zwdx);
                                      the same for the CA file that verifies the server, and the
                                      datasets (``iso.folder``); written as ``sandbox.py`` says
    iso.release(box)                  its ranks exited: end what is left of the job, remove its dir
    iso.signal(proc, signum)          signal a rank (its process group, or its container)
    iso.versions(v), iso.terms()      what ranks run (a container's image: its Python, torch), and
                                      a container's image and limits (None for a process)
    iso.shutdown()                    the agent stops: end what the isolation still holds

A sandbox (``zwdx.protocol.rank.Sandbox``) travels in each rank's ``RankSpec``; the rank process
enters it (``enter``) right after reading its spec and opening its log, before it touches
anything of the job: it moves into the sandbox's ``home`` (its working directory and ``HOME``;
``TMPDIR`` its ``tmp``) and, under a per-job user, drops to the sandbox's uid and gid for good and
is not dumpable (no process of its uid reads its memory or ``/proc/<pid>/environ``).
Rank processes start in a folder of the agent's with ``-P`` (Python 3.11+): no folder a job
can write is on their import path.

Kinds (``zwdx.protocol.Isolation``):

- ``process`` ("same user"): ranks run as the GPU client's own user, each job in a directory of
  its own. Job code can read whatever that user can (its token file, other jobs' files). What a
  GPU client that is not root gets.
- ``user`` ("per-job user", the default as root): the ranks of one job on this GPU client run as
  a uid of their own, taken from a range (``--rank-uids``, no passwd entry needed; uids and gids
  that have an entry are skipped) and held against every other GPU client of the machine (a
  record lock in /run, ``rank_users.py``) while the job runs. Its gid is the same number, with no
  supplementary groups. The sandbox directory is root's (0750, the job's group: read, not
  written), its ``home`` and ``tmp`` (0700) the uid's (``sandbox.py``); everything else the agent keeps (tokens,
  client secret, the bundle cache, other jobs' logs) is root's and 0700/0600, the installed
  zwdx is root's, and other jobs run as other uids, so job code reads none of it (nor their
  ``/proc/<pid>/environ``). The job's bundle is a hard link in the sandbox, read-only (root's,
  0444). When the ranks are gone, every process left of the uid is killed (at once, by
  ``kill(-1)`` as that uid, until none is left) and its files in /tmp, /var/tmp and /dev/shm
  removed, before the uid serves another job; a uid a process of which survives serves none.
- ``docker`` ("container", ``gpu_client/sandbox/container.py``; the default where a Docker engine answers,
  the image is here and the GPU client does not run in a container itself): each rank in a fresh
  container of an image the donor allows, as a non-root uid, read-only root, no capabilities,
  no-new-privileges, the default seccomp profile, pids and memory limits, the rank's GPU only,
  egress only to the server and the job's peers (as root). The sandbox is a directory of the
  container's tmpfs; what ``share`` puts there is streamed in. ``popen`` answers a handle that
  the launcher treats as a rank process; ``signal`` is how the launcher signals any rank.
  ``terms()`` says which image and limits ranks run under (registered per slot, kept on each
  rank's state for the job's page).

One user per job rather than per rank process: the ranks of one job on one machine share
/dev/shm segments and CUDA IPC handles (NCCL), which need one uid. A standby process (started
ahead, while its slot is idle) runs only zwdx's and torch's code until it gets its spec, and
enters the sandbox of the job it takes: it never serves two jobs.
"""
from __future__ import annotations

import grp
import importlib.util
import json
import logging
import os
import pwd
import random
import socket
import stat
import subprocess
import sys
import threading

from zwdx.protocol.rank import CHANNEL_ENV, Sandbox
from zwdx.protocol.vocab import Isolation

from . import rank_users, folder as sandbox

log = logging.getLogger("gpu_client.sandbox.isolation")

#: uids (and as many gids) ranks run as under ``--isolation user``: far from people's (1000...),
#: systemd's (60001-65535) and subordinate ranges (100000... in /etc/subuid).
DEFAULT_UIDS = range(2_000_000_000, 2_000_065_536)
#: Where per-job users' sandboxes live unless ``--rank-dir`` says: every user can traverse it
#: (each sandbox in it is 0700), unlike a home directory.
SYSTEM_RANK_DIR = "/var/lib/zwdx/ranks"
#: The record locks that keep one uid to one job across the GPU clients of a machine.
UID_LOCKS = "/run/zwdx/rank-uids.lock"
#: The directories of the agent's own work dir; private (0700) when ranks run as other users.
AGENT_DIRS = ("secrets", "bundles", "jobs", "standby")
BUNDLE = "bundle.zwdx"
#: Python's options for a rank process: no working directory on its import path (3.11+; older
#: ones start in a folder only the agent writes, ``popen``'s cwd).
SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()


def python_argv(module: str, *args: str) -> list[str]:
    """``python -P -m module args``: how the agent starts its rank processes."""
    return [sys.executable, *SAFE_PATH, "-m", module, *args]


def with_import_root(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a rank process, with the folder the agent imported ``gpu_client`` from first
    on PYTHONPATH where it is the agent's start folder (``sys.path[0]``: a checkout run without
    installing it): ranks find zwdx there by name, not as the folder they start in."""
    import gpu_client
    root = os.path.dirname(os.path.dirname(os.path.abspath(gpu_client.__file__)))
    if not sys.path or root != os.path.abspath(sys.path[0] or os.curdir):
        return env
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)}


class IsolationError(Exception):
    """Ranks cannot be isolated as asked; the message says what to change."""


def parse_uids(text: str) -> range:
    """``"START-END"`` (both included) as a range of uids."""
    try:
        start, end = (int(part) for part in text.split("-"))
    except ValueError:
        raise IsolationError(f"--rank-uids must read START-END (two numbers), got {text!r}") from None
    if not 0 < start <= end < 2**32 - 1:
        raise IsolationError(f"--rank-uids must be a range of uids above 0, got {text!r}")
    return range(start, end + 1)


def private_dir(path: str) -> str:
    """``path`` as a directory only its owner can open (made, or made so)."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if stat.S_IMODE(os.stat(path).st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


class ProcessIsolation:
    """Ranks run as the GPU client's own user, each job in its own directory (see the module)."""

    kind = Isolation.PROCESS
    label = "same user"
    #: Whether a bundle being fetched can be shared into the sandbox as it arrives (a hard link
    #: to the file the agent writes), so that the ranks read it as it grows.
    streams_bundle = True

    def __init__(self, rank_dir: str, work_dir: str):
        self.rank_dir, self.work_dir = os.path.abspath(rank_dir), os.path.abspath(work_dir)

    def check(self) -> None:
        private_dir(self.rank_dir)

    def importable(self, agent_modules: list[str] | None) -> list[str] | None:
        """The top-level modules a rank can import (``host.importable_modules``): the agent's."""
        return agent_modules

    def look_again(self) -> None:
        """Before ``importable`` is asked again (a package installed since): probe anew what needs it."""

    def versions(self, agent_versions: dict) -> dict:
        """The Python and torch its ranks run (the scheduler matches jobs to them): the agent's."""
        return agent_versions

    def terms(self) -> dict | None:
        """The image and limits ranks run under (a container's; None for a process)."""
        return None

    def takes(self, standby, spec) -> bool:
        """Whether a standby process may take this rank (a container: of the job's image)."""
        return True

    def signal(self, proc, signum: int) -> None:
        """Signal a rank process's whole group (gone already is fine)."""
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    def shutdown(self) -> None:
        """The agent stops: end what the isolation still holds (nothing here)."""

    def describe(self) -> str:
        return (f"ranks run as this GPU client's own user (isolation: {self.label}); job code can read what "
                f"that user can, this client's token and secrets included (run it as root for a user per job)")

    #: Whether rank processes get a channel (``popen``) on which the launcher hands them sockets.
    hands_sockets = True

    def popen(self, argv: list[str], stdout, env: dict[str, str]) -> subprocess.Popen:
        """A rank process in its own session (a cancel kills its whole group); its stdin a pipe;
        started in the folder of sandboxes (the agent's, which no job writes). Its ``channel``: a
        Unix socket to it (``CHANNEL_ENV`` names its end there), for listening sockets its spec
        says it gets (``launcher.Launcher.start``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=stdout, stderr=subprocess.STDOUT,
                                    start_new_session=True, env={**env, CHANNEL_ENV: str(theirs.fileno())},
                                    cwd=self.rank_dir, pass_fds=(theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        proc.channel = ours
        return proc

    # -- sandboxes ----------------------------------------------------------------------------------
    def _dir(self, client_id: str, job_id: str, attempt: int) -> str:
        return os.path.join(self.rank_dir, _name(client_id), f"{_name(job_id)}.{attempt}")

    def lease(self, client_id: str, job_id: str, attempt: int) -> Sandbox:
        path = self._dir(client_id, job_id, attempt)
        self._parent(os.path.dirname(path))
        sandbox.make(path)
        return Sandbox(dir=path)

    def _parent(self, path: str) -> None:
        private_dir(path)

    @staticmethod
    def bundle_path(box: Sandbox) -> str:
        return os.path.join(box.dir, BUNDLE)

    def share(self, source: str, box: Sandbox, name: str = BUNDLE, link: bool = True) -> str:
        """A file in the sandbox that the ranks may read and not change (root's, 0444): the job's
        bundle as a hard link (no copy; a copy across file systems), a file the agent does not
        own (the CA file) as a copy; ``name`` may name folders (made). ``sandbox.Refused``
        where the path is not the agent's (a link, a FIFO, a folder it did not make)."""
        return sandbox.place(source, str(box.dir), name, link)

    def folder(self, box: Sandbox, name: str) -> str:
        """A folder in the sandbox that the ranks may read and not change (0755), made."""
        return sandbox.folder(str(box.dir), name)

    def release(self, box: Sandbox) -> None:
        sandbox.remove(str(box.dir))


class UserIsolation(ProcessIsolation):
    """Each job's ranks run as an unprivileged uid of their own (see the module)."""

    kind = Isolation.USER
    label = "per-job user"

    def __init__(self, rank_dir: str, uids: range, work_dir: str):
        super().__init__(rank_dir, work_dir)
        self.uids = uids
        self._locks: rank_users.UidLocks | None = None
        self._held: set[int] = set()
        self._mutex = threading.Lock()
        self._next = random.SystemRandom().randrange(len(uids))
        self._modules: list[str] | None = None  # what a rank user can import (check)

    def describe(self) -> str:
        return (f"ranks run as a user of their own per job (isolation: {self.label}; uids {self.uids.start}-"
                f"{self.uids.stop - 1}), each job in a directory of its own under {self.rank_dir}")

    def check(self) -> None:
        """Everything a per-job user needs, or an IsolationError saying what to change."""
        if os.geteuid() != 0:
            raise IsolationError(f"--isolation user needs the GPU client to run as root (it runs as uid "
                                 f"{os.geteuid()}): start it as root, or pass --isolation process to run ranks as "
                                 f"this user (job code can then read this user's files)")
        _check_mapped(self.uids)
        os.makedirs(self.rank_dir, mode=0o711, exist_ok=True)
        os.chmod(self.rank_dir, 0o711)
        for name in AGENT_DIRS:  # what an older zwdx left readable
            if os.path.isdir(os.path.join(self.work_dir, name)):
                private_dir(os.path.join(self.work_dir, name))
        for path in needed_paths(self.rank_dir):
            blocked = _blocked(path)
            if blocked:
                raise IsolationError(
                    f"ranks run as unprivileged users (--isolation user, the default as root), and those cannot "
                    f"reach {path}: {blocked} is mode {stat.S_IMODE(os.stat(blocked).st_mode):04o} (other users "
                    f"need o+x on every directory above and o+r on the files). Install Python and zwdx where every "
                    f"user can read them (or chmod o+x {blocked}), pick --rank-dir elsewhere, or pass --isolation "
                    f"process to run ranks as root (no isolation)")
        self._probe()

    def importable(self, agent_modules: list[str] | None) -> list[str] | None:
        """What a rank user can import, which may be less than root can (a package on a path only
        root reads): the scheduler keeps jobs that need more away."""
        return self._modules

    def look_again(self) -> None:
        self._probe()

    def _probe(self) -> None:
        """Start Python as a rank user, as a rank starts (``python_argv``, the PYTHONPATH that
        ``launcher.rank_environ`` gives), import the rank's code and list the modules it can import."""
        box = self.lease("probe", f"probe-{os.getpid()}", 0)
        code = ("import gpu_client.sandbox.rank_process, json; from gpu_client.agent.host import importable_modules; "
                "print(json.dumps(importable_modules()))")
        env = with_import_root({k: v for k, v in os.environ.items() if not k.startswith("ZWDX_")})
        try:
            done = subprocess.run([sys.executable, *SAFE_PATH, "-c", code], capture_output=True, user=box.uid,
                                  group=box.gid, extra_groups=[], timeout=120, env=env, cwd=sandbox.home(box))
        except (OSError, subprocess.SubprocessError) as exc:
            raise IsolationError(f"a rank cannot start as uid {box.uid}: {exc}") from exc
        finally:
            self.release(box)
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise IsolationError(f"Python cannot import zwdx's rank code as uid {box.uid} (--isolation user): "
                                 f"{' / '.join(tail)}; pass --isolation process to run ranks as this user")
        self._modules = json.loads(done.stdout.decode().strip().splitlines()[-1])

    def _parent(self, path: str) -> None:
        os.makedirs(path, mode=0o711, exist_ok=True)
        os.chmod(path, 0o711)

    def lease(self, client_id: str, job_id: str, attempt: int) -> Sandbox:
        uid = self._take_ended()
        try:
            path = self._dir(client_id, job_id, attempt)
            self._parent(os.path.dirname(path))
            sandbox.make(path, owner=uid)
        except BaseException:
            self._give(uid)
            raise
        return Sandbox(dir=path, uid=uid, gid=uid)

    def release(self, box: Sandbox) -> None:
        ended = box.uid is None or rank_users.end(box.uid)
        super().release(box)
        if box.uid is not None and ended:
            self._give(box.uid)
        elif box.uid is not None:  # kept held (this client's lock), never handed out again by it
            log.error("uid %d: a process of job sandbox %s survived SIGKILL; the uid serves no other job",
                      box.uid, box.dir)

    # -- the uids -----------------------------------------------------------------------------------
    def _take_ended(self) -> int:
        """A uid of the range, no process of which is alive (what a killed agent's job left is
        ended first; a uid whose processes survive that stays held, and the next is tried)."""
        while True:
            uid = self._take()
            if rank_users.end(uid):
                return uid
            log.error("uid %d: processes of an earlier job survived SIGKILL; it serves no job", uid)

    def _take(self) -> int:
        with self._mutex:
            if self._locks is None:
                private_dir(os.path.dirname(UID_LOCKS))
                self._locks = rank_users.UidLocks(UID_LOCKS)
            for step in range(len(self.uids)):
                offset = (self._next + step) % len(self.uids)
                uid = self.uids[offset]
                if uid in self._held or _has_entry(uid):
                    continue
                if not self._locks.take(uid):
                    continue  # another GPU client of this machine holds it
                self._held.add(uid)
                self._next = offset + 1
                return uid
        raise IsolationError(f"every uid of --rank-uids {self.uids.start}-{self.uids.stop - 1} is in use")

    def _give(self, uid: int) -> None:
        with self._mutex:
            self._held.discard(uid)
            self._locks.give(uid)


# -- helpers ----------------------------------------------------------------------------------------
def _name(text: str) -> str:
    """An id as one path component (ids are [A-Za-z0-9._:-]; never '.' or '..')."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in text)
    return safe if safe.strip(".") else f"_{safe}"


def _has_entry(uid: int) -> bool:
    """Whether the uid is a user's, or its number a group's (the rank's gid is the same number)."""
    for lookup in (pwd.getpwuid, grp.getgrgid):
        try:
            lookup(uid)
            return True
        except KeyError:
            pass
    return False


def needed_paths(rank_dir: str) -> list[str]:
    """What a per-job user must reach: the sandboxes, Python, its standard library, zwdx, torch."""
    import gpu_client
    torch = importlib.util.find_spec("torch")
    return [rank_dir, os.path.realpath(sys.executable), os.path.dirname(os.__file__),
            os.path.dirname(os.path.dirname(gpu_client.__file__)), *([torch.origin] if torch else [])]


def _blocked(path: str) -> str | None:
    """The first directory above ``path`` (or ``path``) that other users cannot pass, or None."""
    path = os.path.abspath(path)
    parts = [path]
    while os.path.dirname(parts[-1]) != parts[-1]:
        parts.append(os.path.dirname(parts[-1]))
    for part in reversed(parts):
        mode = os.stat(part).st_mode
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return part
        if not stat.S_ISDIR(mode) and not mode & stat.S_IROTH:
            return part
    return None


def _check_mapped(uids: range) -> None:
    """The uids exist in this user namespace (a container may map only a few)."""
    try:
        with open("/proc/self/uid_map") as fh:
            maps = [tuple(int(v) for v in line.split()) for line in fh if line.strip()]
    except OSError:
        return
    if not any(inside <= uids.start and uids.stop <= inside + count for inside, _, count in maps):
        mapped = ", ".join(f"{inside}-{inside + count - 1}" for inside, _, count in maps)
        raise IsolationError(f"--rank-uids {uids.start}-{uids.stop - 1} are not all mapped in this user namespace "
                             f"(mapped: {mapped}): pick a range inside it")


if __name__ == "__main__":
    # python -m gpu_client.sandbox.isolation [RANK_DIR]: the directories that keep per-job users from
    # Python, zwdx or torch, one a line (setup.sh makes them traversable, o+x, as root)
    for blocked in sorted({_blocked(p) for p in needed_paths(sys.argv[1] if len(sys.argv) > 1 else "/")} - {None}):
        if os.path.isdir(blocked):
            print(blocked)
