"""One rank of a script job (``zwdx run``): the submitter's torchrun script, run unchanged.

The rank process (``runner.py`` picks this way to run from its ``RankSpec``'s kind) waits for
the job's working dir (the agent fetches it once per GPU client, by its sha256), unpacks it
into a folder of its own with tarfile's ``data`` filter (no absolute paths, no ``..``, no links
out of the tree, no devices), and runs ``python PATH ARGS...`` there as its child, with
torchrun's environment:

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
    ROLE_WORLD_SIZE, ROLE_NAME, MASTER_ADDR, MASTER_PORT (the address rank 0's GPU client
    offered: rank 0's ScriptRank serves the job's store there, on the socket its GPU client held
    since it offered the port, as torchrun's agent does), TORCHELASTIC_USE_AGENT_STORE (True:
    every rank's ``init_process_group`` is a client of that store), TORCHELASTIC_RUN_ID (the job
    id), TORCHELASTIC_RESTART_COUNT (the attempt: 0, then 1
    after the first restart), TORCHELASTIC_MAX_RESTARTS; CUDA_VISIBLE_DEVICES (this client's
    GPUs of the job in local-rank order, so ``cuda:LOCAL_RANK`` is the rank's own; empty on a
    CPU slot); ZWDX_OUTPUT_DIR, ZWDX_JOB_ID; ZWDX_DATA_DIR (the job's datasets, one folder each,
    when it names any); and the job's ``env``.

The script's stdout and stderr lines are the job's log lines as they come (and the rank's log
file); its exit code is the rank's outcome: 0 completed, else failed with the tail of its
stderr as the traceback (``exit_code``: the server waits to see whether a GPU client was lost,
and the job resumes then, as torchrun restarts its workers); when it could not open a file the
submitter's .gitignore left out of the working dir, the failure says so. ``$ZWDX_OUTPUT_DIR``
and ``$ZWDX_DATA_DIR`` (``${...}`` too) in its arguments are the rank's own folders. Rank 0's
``$ZWDX_OUTPUT_DIR`` and the folders ``outputs_from`` names are uploaded as one tar before it
reports (``gpu_client.rank.outputs``: no link followed); when there are none, rank 0 says in the
job's log which files its script wrote in its working dir. The other ranks' are dropped. The
rank's folder is removed at the end. The rank key stays in this process: not in the script's environment, not on
its command line, and its stdin is ``/dev/null``.
"""
from __future__ import annotations

import collections
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import traceback

import requests

from zwdx.archives import data_filter_missing
from zwdx.protocol.rank import RankSpec
from zwdx.protocol.script import VARIABLE
from zwdx.protocol.vocab import JobKind, RankStatus, SlotKind

from . import outputs as collect
from .reporter import Reporter

log = logging.getLogger("gpu_client.rank.script")

#: Lines of the script's stderr kept as the traceback of a failure; and the longest log line.
TAIL_LINES = 200
MAX_LINE = 100_000

#: Runs first in the script's process: it dies with this rank process (as the rank dies with its
#: GPU client), then becomes ``python PATH ARGS...`` (exec: the script's own argv, pid and stdio).
_TRAMPOLINE = """import os, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def rank_fields(assign, place, local_rank: int, job_dir: str) -> dict:
    """What a script job adds to a rank's ``RankSpec`` (the agent's ``JobAssign`` -> ``RankSpec``);
    ``job_dir``: a folder the job's ranks write (its sandbox's ``home``)."""
    if assign.spec.kind != JobKind.SCRIPT:
        return {}
    return {"local_world_size": len(assign.ranks), "group_rank": assign.group_rank,
            "group_world_size": assign.group_world_size,
            "local_gpus": [r.gpu_index for r in assign.ranks if r.kind == SlotKind.CUDA],
            "work_dir": os.path.join(job_dir, f"attempt{assign.attempt}", f"rank{place.rank}")}


def unpack(archive: str, dest: str, where: str = "this GPU client") -> set[str]:
    """The working dir's archive into ``dest``; an entry that would land outside it (or is a
    device, a link out of the tree) is refused, naming it, and nothing is run. ``where``: the
    GPU client, as a refusal names it. The names it unpacked."""
    missing = data_filter_missing()
    if missing:
        raise RuntimeError(f"{where}: its {missing}: it does not unpack working dirs")
    os.makedirs(dest, exist_ok=True)
    try:
        with tarfile.open(archive, "r:*") as tar:
            tar.extractall(dest, filter="data")
            return {m.name.lstrip("/") for m in tar.getmembers()}
    except tarfile.FilterError as exc:
        raise ValueError(f"the working dir's archive is refused: {exc}") from None


def expand(arg: str, env: dict[str, str]) -> str:
    """``arg`` with ``$ZWDX_OUTPUT_DIR``, ``$ZWDX_DATA_DIR`` (and ``${...}``) replaced by the
    rank's folders; any other ``$`` text stays as it is (no shell, no other variable)."""
    return VARIABLE.sub(lambda m: env.get(m.group(1) or m.group(2), m.group(0)), arg)


def environ(spec: RankSpec, outputs: str) -> dict[str, str]:
    """The script's environment: this process's (no secret is in it), the job's ``env``, then
    torchrun's variables and zwdx's."""
    script = spec.script
    return {**os.environ, **script.env,
            "RANK": str(spec.rank), "LOCAL_RANK": str(spec.local_rank), "WORLD_SIZE": str(spec.world_size),
            "LOCAL_WORLD_SIZE": str(spec.local_world_size), "GROUP_RANK": str(spec.group_rank),
            "GROUP_WORLD_SIZE": str(spec.group_world_size), "ROLE_RANK": str(spec.rank),
            "ROLE_WORLD_SIZE": str(spec.world_size), "ROLE_NAME": "default",
            "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.master_port),
            # as under torchrun: the store at MASTER_ADDR:MASTER_PORT is the agent's (rank 0's
            # ScriptRank serves it), every rank of the script a client of it
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": spec.job_id, "TORCHELASTIC_RESTART_COUNT": str(spec.attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "CUDA_VISIBLE_DEVICES": visible_devices(spec.local_gpus), "PYTHONUNBUFFERED": "1",
            "ZWDX_OUTPUT_DIR": outputs, "ZWDX_JOB_ID": spec.job_id,
            **({"ZWDX_DATA_DIR": spec.data_dir} if spec.data_dir else {})}


def visible_devices(gpus: list[int]) -> str:
    """CUDA_VISIBLE_DEVICES for these GPU indexes of the GPU client, through the one it was
    started with, if any ("" on a CPU slot: the script sees no GPU)."""
    given = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(given[i] if i < len(given) else str(i) for i in gpus)


def _signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class ScriptRank:
    """One rank of a script job: ``run`` unpacks, runs the script, uploads rank 0's outputs
    and reports; it returns the rank process's exit code."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.folder = spec.work_dir or tempfile.mkdtemp(prefix=f"zwdx-{spec.job_id}-rank{spec.rank}-")
        self.tree = os.path.join(self.folder, "tree")
        self.outputs = os.path.join(self.folder, "outputs")
        self.reporter: Reporter | None = None
        self.proc: subprocess.Popen | None = None
        self.root: int | None = None  # the rank's folder, opened before the script runs
        self.unpacked: set[str] = set()
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)

    def _reporter(self) -> Reporter:
        spec = self.spec
        return Reporter(spec.server, spec.rank_key.get_secret_value(), spec.job_id, spec.rank, attempt=spec.attempt,
                        verify=spec.ca_file or True, patience=spec.outage_tolerance)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, _stop)  # a cancel: the script gets it too (one process group); tidy up
        try:
            self._prepare()
            self.reporter = self._reporter()
            code = self._run()
            self._upload_outputs(code)
            self._report(code)
            return 0 if code == 0 else 1
        except Stopped:  # cancelled, or the job stopped: nothing to report
            return 1
        except BaseException as exc:  # report every failure of zwdx's own part, then exit non-zero
            self._fail(exc)
            return 1
        finally:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            if self.root is not None:
                os.close(self.root)
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.reporter is not None:
                self.reporter.close()

    def _prepare(self) -> None:
        """Wait for the working dir, unpack it, find the script."""
        spec = self.spec
        if spec.bundle_pending and not sys.stdin.readline().strip():
            raise RuntimeError("the GPU client could not fetch the job's working dir")
        self.unpacked = unpack(spec.bundle_path, self.tree, spec.where)
        os.makedirs(self.outputs, exist_ok=True)
        self.root = collect.open_root(self.folder)
        if not os.path.isfile(os.path.join(self.tree, spec.script.path)):
            raise FileNotFoundError(f"the working dir has no script {spec.script.path}")

    def _serve_store(self):
        """Rank 0: the job's store, as torchrun's agent serves it, on the rendezvous socket its GPU
        client handed over (held since it offered the port; a container's rank binds it here)."""
        import datetime
        from .rendezvous import tcp_store
        spec = self.spec
        return tcp_store(spec.master_addr, spec.master_port, spec.world_size, True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=spec.collective_timeout), multi_tenant=True)

    def _run(self) -> int:
        """The script, to its end: its lines streamed as they come; its exit code."""
        spec = self.spec
        store = self._serve_store() if spec.rank == 0 else None  # noqa: F841 (serves while the script runs)
        env = environ(spec, self.outputs)
        argv = [sys.executable, "-S", "-c", _TRAMPOLINE, str(os.getpid()), sys.executable, spec.script.path,
                *(expand(arg, env) for arg in spec.script.args)]
        self.proc = subprocess.Popen(argv, cwd=self.tree, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.reporter.status(RankStatus.RUNNING.value)
        pumps = [threading.Thread(target=self._pump, args=(self.proc.stdout, sys.stdout, False), daemon=True),
                 threading.Thread(target=self._pump, args=(self.proc.stderr, sys.stderr, True), daemon=True)]
        for pump in pumps:
            pump.start()
        code = self.proc.wait()
        for pump in pumps:  # a child the script left behind may hold the pipes: do not wait for it
            pump.join(timeout=5)
        return code

    def _pump(self, pipe, echo, errors: bool) -> None:
        """The script's lines, each to the rank's log file and the job's log."""
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            try:
                echo.write(line + "\n")
                echo.flush()
            except (OSError, ValueError):
                pass
            if errors:
                self.tail.append(line)
            if line.strip():
                self.reporter.log(line[:MAX_LINE])

    def _upload_outputs(self, code: int) -> None:
        """Rank 0: what the script wrote under ``$ZWDX_OUTPUT_DIR`` and the folders of
        ``outputs_from`` (under their own names), as the job's outputs; when there is nothing,
        where it wrote instead, in the job's log."""
        if self.spec.rank != 0:
            return
        archive = os.path.join(self.folder, "outputs.tar")
        folders = [("outputs", ""), *((f"tree/{d}", f"{d}/") for d in self.spec.script.outputs_from)]
        count = collect.pack(self.root, folders, archive)
        if count == 0:
            made = collect.written(self.root, "tree", self.unpacked)
            if made or code == 0:  # a script that failed before writing anything: its failure says enough
                note = collect.no_outputs_note(made, self.spec.script.outputs_from)
                log.info("job %s: %s", self.spec.job_id, note)
                self.reporter.log(note)
            return
        try:
            self.reporter.upload("outputs", archive)
        except requests.HTTPError as exc:  # the server's words: a quota, a size limit
            raise RuntimeError(f"the outputs ($ZWDX_OUTPUT_DIR, {os.path.getsize(archive)} bytes) could not be "
                               f"uploaded: {exc.response.text[:500]}") from None
        log.info("job %s: %d output entries uploaded (%d bytes)", self.spec.job_id, count, os.path.getsize(archive))

    def _report(self, code: int) -> None:
        if code == 0:
            self.reporter.status(RankStatus.COMPLETED.value, results={})
            return
        how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with code {code}"
        tail = "\n".join(self.tail).strip() or "(the script wrote nothing to stderr)"
        error = f"script {self.spec.script.path} {how}"
        hint = collect.left_out_hint(self.tail, self.spec.script.left_out, self.tree)
        if hint:
            error, tail = f"{error}: {hint}", f"{tail}\nzwdx: {hint}"
        self.reporter.status(RankStatus.FAILED.value, error=error, traceback=tail,
                             exit_code=max(-255, min(255, code)))

    def _fail(self, exc: BaseException) -> None:
        """zwdx's part failed (the working dir, the outputs' upload, a cancel): say why."""
        tb = "".join(traceback.format_exception(exc))
        sys.__stderr__.write(tb)
        try:
            if self.reporter is None:
                self.reporter = self._reporter()
            self.reporter.status(RankStatus.FAILED.value, error=f"{type(exc).__name__}: {exc}", traceback=tb)
        except Exception:
            log.exception("could not report the failure")


class Stopped(SystemExit):
    """SIGTERM: the GPU client stops the job's ranks (a cancel, a failed or interrupted job)."""


def _stop(signum, _frame):
    raise Stopped(128 + signum)
