"""How a rank failed: did its own code raise, or did it lose its peers?

The answer decides what the server does (``FailureKind``): a rank whose code raised fails the
job at once and comes first in its ``failure_order``; a rank that lost its peers makes the job
wait to see whether a GPU client was lost (then it resumes from its last checkpoint).

It is decided by where the exception came from, never by the words of its message (a user's
own ``TimeoutError("timed out reading data")`` is the user's):

- torch.distributed's own exception types (``DistError`` and its kinds: backend, network, store);
- a ``RuntimeError`` or ``OSError`` raised inside torch.distributed's code (the innermost frame
  of its traceback is there, or in DDP's module; torch's op dispatcher, ``torch/_ops.py``,
  through which the functional collectives call their ops, does not count as a frame): a
  collective, the rendezvous store, DDP's bucket rebuild or buffer broadcast, FSDP's
  all-gathers and reduce-scatters, the all-reduces and all-gathers of TP's DTensors. Not
  DTensor's own code (``torch/distributed/tensor/``: an op it cannot split is the model's);
- a collective zwdx runs for the user that failed before (``collectives.failed``): DDP's
  gradient all-reduce runs inside the autograd engine, whose C++ error reaches ``backward()``
  as a bare ``RuntimeError`` with no torch.distributed frame, so on CPU (gloo) zwdx issues
  that all-reduce itself (``watch_gradients``) and notes its failure. On GPUs NCCL's errors are
  ``DistBackendError`` already, or its watchdog ends the process (a rank that exits without a
  word is "exited": a lost peer too).

An exception whose cause or context is one of those counts as one: the user's ``except``
around a collective that turns its error into another is still a lost peer.

Also here: ``MissingPackage``, an import the job's code needs that this GPU client lacks.
"""
from __future__ import annotations

import os
import threading

#: torch.distributed's code, and DDP's module (which runs collectives in its forward); and
#: DTensor's code and torch's op dispatcher, which are not (see ``_innermost_file``).
_DISTRIBUTED_CODE: tuple[str, ...] | None = None
_NOT_DISTRIBUTED: tuple[str, ...] | None = None


class CollectiveWatch:
    """The collectives zwdx runs on the user's behalf: the first that failed, if any."""

    def __init__(self):
        self.failed: BaseException | None = None
        self._lock = threading.Lock()

    def record(self, exc: BaseException) -> None:
        with self._lock:
            if self.failed is None:
                self.failed = exc


#: One rank per process, so one watch per process.
collectives = CollectiveWatch()


def watch_gradients(model, weight: float | None = None) -> None:
    """DDP's gradient all-reduce as a comm hook that notes a failure in ``collectives``. Same
    arithmetic as DDP's own (each bucket divided by the world size, then summed), on gloo
    (CPU) only: see the module's docstring. ``weight``: each bucket multiplied by it instead
    (a mixed-devices rank's share of the global batch, ``mixed.py``). A DDP model takes one comm
    hook: the user's code cannot register another on a CPU job's model."""
    import torch.distributed as dist

    def allreduce(watch: CollectiveWatch, bucket):
        tensor = bucket.buffer().div_(dist.get_world_size()) if weight is None else bucket.buffer().mul_(weight)

        def settled(fut):
            try:
                return fut.value()[0]
            except Exception as exc:
                watch.record(exc)
                raise
        try:
            return dist.all_reduce(tensor, async_op=True).get_future().then(settled)
        except Exception as exc:
            watch.record(exc)
            raise
    model.register_comm_hook(collectives, allreduce)


def _distributed_code() -> tuple[str, ...]:
    global _DISTRIBUTED_CODE, _NOT_DISTRIBUTED
    if _DISTRIBUTED_CODE is None:
        import torch
        import torch.distributed
        import torch.nn.parallel.distributed
        here = os.path.dirname(os.path.realpath(torch.distributed.__file__))
        _DISTRIBUTED_CODE = (here + os.sep, os.path.realpath(torch.nn.parallel.distributed.__file__))
        _NOT_DISTRIBUTED = (os.path.join(here, "tensor") + os.sep,)
    return _DISTRIBUTED_CODE


def _dispatcher() -> str:
    import torch
    return os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "_ops.py")


def _innermost_file(exc: BaseException) -> str | None:
    """The file of the innermost frame of ``exc``'s traceback that is not torch's op dispatcher."""
    files = []
    tb = exc.__traceback__
    while tb is not None:
        files.append(os.path.realpath(tb.tb_frame.f_code.co_filename))
        tb = tb.tb_next
    dispatcher = _dispatcher()
    return next((f for f in reversed(files) if f != dispatcher), None)


def _chain(exc: BaseException):
    """The exception, then its causes and contexts (each once)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ if exc.__cause__ is not None else None if exc.__suppress_context__ else exc.__context__


def raised_by_distributed(exc: BaseException) -> bool:
    """True when torch.distributed raised ``exc``: one of its types, or an error raised in its code."""
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(dist, n, None) for n in ("DistError", "DistBackendError", "DistNetworkError",
                                                               "DistStoreError")) if isinstance(k, type))
    if kinds and isinstance(exc, kinds):
        return True
    if not isinstance(exc, (RuntimeError, OSError)):
        return False
    where = _innermost_file(exc)
    return where is not None and any(where == code or where.startswith(code) for code in _distributed_code()) \
        and not where.startswith(_NOT_DISTRIBUTED)


def is_collective_error(exc: BaseException) -> bool:
    """True when the rank lost its peers (see the module's docstring); False when its own code raised."""
    return any(raised_by_distributed(e) for e in _chain(exc)) or collectives.failed is not None


class MissingPackage(ImportError):
    """The job's code imports a package that this GPU client does not have (or has in a
    version without what the code needs)."""


def missing_package(exc: ImportError, where: str) -> MissingPackage:
    """``exc`` said in the submitter's words: which package, on which GPU client and host."""
    if not exc.name:
        return MissingPackage(f"{where} cannot import what the job needs: {exc}")
    name = exc.name.split(".")[0]
    if isinstance(exc, ModuleNotFoundError):
        return MissingPackage(f"{where} lacks package '{name}' (No module named '{exc.name}'); "
                              f"install it there", name=name)
    return MissingPackage(f"{where} cannot import from package '{name}': {exc} (another version of it "
                          f"than the submitter's?)", name=name)
