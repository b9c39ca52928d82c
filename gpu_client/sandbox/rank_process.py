"""A rank process, from its start to its rank: ``python -P -m gpu_client.sandbox.rank_process
[--standby DEVICE]``, as the launcher starts one per slot (``isolation.python_argv``).

It dies with the GPU client, warms up as a standby would (``rank.standby.prepare``) when asked,
reads its ``RankSpec`` (one JSON line on stdin) and its GPU client's switches (``Tuning``, from
its environment), takes its listeners and its log, enters the
job's sandbox (``enter``: the job's private directory and, under a per-job user, that user for
good) before anything of the job is read, then runs ``rank.runner.rank_for(spec)``. The rank's
own code knows its spec only; who started it and how it is confined are this module's.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile

from zwdx.protocol.rank import RankSpec, Sandbox

from gpu_client.rank.rendezvous import take_listeners
from gpu_client.rank.runner import rank_for
from gpu_client.rank.standby import prepare
from gpu_client.rank.tuning import Tuning

from . import compile_cache, folder as sandbox


def die_with_parent() -> None:
    """If the GPU client dies (SIGKILL, lost machine), its ranks die with it."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        if os.getppid() == 1:
            os._exit(1)
    except OSError:
        pass


def write_output_to(path: str | None) -> None:
    """This process's stdout and stderr go to ``path`` (a standby's went to its slot's log)."""
    if not path:
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main(argv: list[str]) -> int:
    die_with_parent()
    tuning = Tuning.from_environ()  # the GPU client's switches, set in this process's environment
    if argv[:1] == ["--standby"] and len(argv) == 2:
        prepare(argv[1], tuning.standby_warmup)
    spec = RankSpec.read(sys.stdin)
    if spec is None:
        return 0  # the GPU client let this process go before giving it a rank
    take_listeners(spec.listeners)  # the sockets of the stores this rank serves, held since offered
    write_output_to(spec.log_path)
    enter(spec.sandbox)
    die_with_parent()  # a change of user cleared it
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {spec.rank} %(name)s: %(message)s")
    return rank_for(spec, tuning).run()


def enter(box: Sandbox | None) -> None:
    """In a rank process, once it read its spec and opened its log, before anything of the job:
    into the sandbox's directory and, under a per-job user, its uid and gid for good."""
    if box is None:
        return
    os.chdir(sandbox.home(box))
    if box.uid is not None:
        os.setgroups([])
        os.setresgid(box.gid, box.gid, box.gid)
        os.setresuid(box.uid, box.uid, box.uid)
        if os.getresuid() != (box.uid,) * 3 or os.getresgid() != (box.gid,) * 3 or os.getgroups():
            raise PermissionError(f"could not become uid {box.uid}")
        _not_dumpable()
        os.environ.update(USER=f"zwdx-{box.uid}", LOGNAME=f"zwdx-{box.uid}")  # no passwd entry to read it from
    os.umask(0o077)
    os.environ.update(HOME=sandbox.home(box), TMPDIR=sandbox.tmp(box))
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    compile_cache.point(box)  # torch.compile's caches: a standby resolved them as root


def _not_dumpable() -> None:
    """No other process of the uid (a job's leftover, had one survived) may read this one's
    memory (its rank key) through /proc/<pid>/mem or ptrace; the rank's own code loses only its
    /proc/self/{environ,auxv,io,mem}. A change of uid made it so already (fs.suid_dumpable 0);
    said again, as that sysctl may differ. An exec (a script job's child) makes a process dumpable."""
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise PermissionError(f"could not make rank process {os.getpid()} non-dumpable")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
