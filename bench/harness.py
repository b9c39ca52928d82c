"""What every benchmark shares: the zwdx server and GPU clients as child processes (started
and stopped by pid, never by name: zwdx/testing.py's, as the tests use), free ports, a
process's CPU time and memory, percentiles and plain-text tables.

The benchmarks are run from the repository root (``python bench/NAME.py``); this module puts
the root on ``sys.path`` so zwdx imports without being installed.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# The child processes (any command, the server, GPU clients, nx-27017) and waiting for them are
# zwdx/testing.py's, which the test suite uses too.
from zwdx.testing import (BalancerProc, Child, GpuClientProc, MongoProc, RedisProc, ServerProc, free_port,  # noqa: E402,F401
                          wait_until)

#: What the server and a GPU client need, by import name (the wheels to carry to a bare host).
SERVER_MODULES = ["flask", "flask_socketio", "socketio", "engineio", "simple_websocket", "gevent", "requests"]
CLIENT_MODULES = ["socketio", "engineio", "websocket", "requests", "cloudpickle", "safetensors", "torch"]


def require(modules: list[str]) -> None:
    """Exit with one clear line when an import is missing (better than a child's traceback)."""
    missing = [m for m in dict.fromkeys(modules) if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"bench: missing Python modules: {', '.join(missing)} "
                 f"(see bench/requirements.txt; PYTHONPATH={os.environ.get('PYTHONPATH', '')})")


def raise_fd_limit() -> int:
    """Lift this process's open-file limit to the hard limit (children inherit it): a server
    holding a thousand clients needs a few thousand descriptors. Returns the limit now."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError):
            return soft
    return want


def mongo_store_available() -> bool:
    return importlib.util.find_spec("zwdx.server.store.mongo") is not None


def run_arguments(parser, timeout: float = 300) -> None:
    """The options of a bench that runs jobs of several ways (strategies.py, auto.py): the batch and
    PIPELINE's split, steps, repeats, threads, ``timeout`` s a job may take, where the tables go."""
    parser.add_argument("--global-batch", type=int, default=None, help="samples a step over all ranks")
    parser.add_argument("--microbatches", type=int, default=8, help="PIPELINE's micro-batches a step")
    parser.add_argument("--schedule", default="1f1b", help="PIPELINE's schedule: gpipe, 1f1b")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each way, each way first in turn")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds after the standbys are ready")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    parser.add_argument("--timeout", type=float, default=timeout, help="seconds one job may take")
    parser.add_argument("--out", default=None, help="append the table here (and raw figures to OUT.json)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (logs)")


# -- measuring a process ------------------------------------------------------------------------
def proc_status(pid: int) -> dict:
    """VmRSS and VmHWM (peak RSS, kept by the kernel) of a process, in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "Threads"):
                parts = value.split()
                out[key] = int(parts[0]) * (1024 if key != "Threads" else 1)
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


class Sampler:
    """Samples a process's RSS every ``interval`` seconds in a thread: ``samples`` is
    ``[(t, rss_bytes)]``; ``peak`` the largest seen."""

    def __init__(self, pid: int, interval: float = 0.05):
        self.pid, self.interval = pid, interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _run(self):
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), proc_status(self.pid)["VmRSS"]))
            except (OSError, KeyError):
                return
            self._stop.wait(self.interval)

    @property
    def peak(self) -> int:
        return max((r for _, r in self.samples), default=0)


# -- figures and tables -------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks; NaN for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def median(values: list[float]) -> float:
    return percentile(values, 50)


def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def table(headers: list[str], rows: list[list], title: str = "", digits: int = 1) -> str:
    """A plain-text table (numbers right-aligned, text left), in Markdown pipe syntax (pastes anywhere)."""
    cells = [[str(h) for h in headers]] + [[c if isinstance(c, str) else fmt(c, digits) for c in row] for row in rows]
    left = [[True] * len(headers)] + [[isinstance(c, str) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [f"### {title}", ""] if title else []
    for n, row in enumerate(cells):
        lines.append("| " + " | ".join(c.ljust(w) if left[n][i] else c.rjust(w)
                                       for i, (c, w) in enumerate(zip(row, widths))) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines) + "\n"


def machine() -> str:
    """One line about where the figures come from: CPU count, GPU model and count, versions."""
    parts = [f"{os.cpu_count()} CPU cores", f"Python {sys.version.split()[0]}"]
    try:
        import torch
        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    try:  # through NVML: no CUDA context in this process
        import pynvml
        pynvml.nvmlInit()
        names = [pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
                 for i in range(pynvml.nvmlDeviceGetCount())]
        if names:
            name = names[0].decode() if isinstance(names[0], bytes) else names[0]
            parts.insert(0, f"{len(names)} x {name} (driver {pynvml.nvmlSystemGetDriverVersion()})")
    except Exception:
        pass
    return ", ".join(parts)


def stop_all(started: list, work: str, keep: bool) -> None:
    """Stop every process a bench started (in ``started``'s order), then remove its work dir
    (``keep``: leave it, and say where)."""
    # the GPU clients (listed before their servers) all at once, then what is left
    clients = [p for p in started if isinstance(p, GpuClientProc)]
    Child.stop_all(clients)
    for proc in started:
        if proc not in clients:
            proc.stop()
    if keep:
        print(f"logs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


def finish(out: str | None, text: str, failures: list[str], data: dict) -> int:
    """Print a bench's tables, with the runs that failed after them; append both to ``out``
    (``write_out``, ``failures`` in the raw figures too). The exit code: 1 if a run failed."""
    if failures:
        text += "\nRuns that failed (not in the tables):\n" + "".join(f"- {f[:2000]}\n" for f in failures)
    print(text)
    write_out(out, text, {**data, "failures": failures})
    return 1 if failures else 0


def write_out(path: str | None, text: str, data: dict | None = None) -> None:
    """Write the tables to ``path`` (and the raw figures to ``path`` + ``.json``)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as fh:
        fh.write(text)
    if data is not None:
        with open(path + ".json", "a") as fh:
            fh.write(json.dumps(data) + "\n")
