"""Checkpoints of a job, written and read by its ranks through the server's artifact store.

The format follows the job's parallelism (``zwdx.protocol.checkpoint``, which the server
enforces), never what a file or a record says:

- DDP (``torch``): rank 0 saves the model and optimizer state (``state.pt``) and the state of
  the objects ``train_func`` gave to ``reporter.track`` (``extra.pt``); every rank its random
  number generators (``rng-<rank>.pt``). Each is read with ``torch.load(weights_only=True)``
  and torch's own allowlist only (``plain_load``): no global a library or the job's code added
  at run time, and the result checked to be the shape zwdx wrote.
- PIPELINE (``stages``): as DDP's, but every rank saves its own stage's model and optimizer
  state (``stage-<rank>.pt``), and restores it.
- FSDP (``shards``): every rank writes its local shards of the model and optimizer state,
  its generators and (rank 0) the tracked state as safetensors with a JSON index
  (``shards.py``), with no full gather on one rank; a resumed job of any world size reads
  every index and the slices it needs. No pickle: ``torch.distributed.checkpoint``'s
  ``.metadata`` is one, so its ``dcp`` checkpoints (of earlier versions) are never read.

Rank 0 commits a checkpoint once every rank has uploaded its files (they meet at a barrier; no
object collective, which would unpickle what the other ranks send); the server keeps the last N.
Tracked objects get their state back as each is tracked again on resume; each rank's generators
go back on the same rank.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import tempfile
import threading
import time

import requests
import torch

from zwdx.protocol import checkpoint as files_of
from zwdx.protocol.job import CheckpointEntry
from zwdx.protocol.vocab import CheckpointFormat, Parallelism

from . import shards
from .staging import Staging

log = logging.getLogger(__name__)

#: The file of a DDP checkpoint that holds the tracked objects' state (written by rank 0).
EXTRA = files_of.EXTRA


class Checkpointer:
    def __init__(self, reporter, model, optimizer, parallelism: Parallelism, rank: int, world: int, device,
                 latest: CheckpointEntry | None = None, commit_timeout: float = 600.0, writes: bool = True):
        self.reporter, self.model, self.optimizer = reporter, model, optimizer
        #: False for a DILOCO shadow (``zwdx.verify``): it restores as the worker it runs again
        #: (``rank`` is the worker's: the same generators, the same state) and writes nothing.
        self.writes = writes
        self.parallelism, self.rank, self.world, self.device = parallelism, rank, world, device
        self.latest = latest  # the checkpoint this attempt goes on from
        self.next_n = (latest.n + 1) if latest else 0
        self.tracked: dict[str, object] = {}  # name -> object with state_dict()/load_state_dict()
        self.tracked_state: dict = {}         # name -> its state in the checkpoint restored
        self.rng_state: dict | None = None    # this rank's generators in the checkpoint restored
        self.staging = Staging()              # host buffers the tensors are copied into, reused
        self.stall = 0.0                      # how long the last save held training up, s
        self.commit_timeout = commit_timeout  # how long rank 0 waits for the other ranks' files, s
        self._pending: threading.Thread | None = None  # the last checkpoint's background work
        self._failed: BaseException | None = None
        if self.format == CheckpointFormat.SHARDS:
            # Imported now, before training, not at the first save: its first import brings in
            # torch.distributed.elastic, whose rendezvous registry reads every installed package's
            # entry points, and held the first FSDP checkpoint for tenths of a second.
            import torch.distributed.checkpoint.state_dict  # noqa: F401

    # -- the user's extra state ----------------------------------------------------------------
    def track(self, obj, name: str | None = None):
        """Save ``obj.state_dict()`` with every checkpoint; on resume, load it back now."""
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise TypeError(f"reporter.track needs an object with state_dict() and load_state_dict(), "
                            f"got {type(obj).__name__}")
        key = str(name) if name is not None else f"{type(obj).__name__}-{len(self.tracked)}"
        if key in self.tracked:
            raise ValueError(f"reporter.track: {key!r} is tracked already; give each object its own name")
        self.tracked[key] = obj
        if key in self.tracked_state:
            obj.load_state_dict(self.tracked_state[key])
        elif self.latest and self.rank == 0:
            self.reporter.log(f"checkpoint {self.latest.n} holds no state for {key!r}: it starts afresh")
        return obj

    def restore_rng(self) -> None:
        """Put this rank's random number generators back where the checkpoint found them."""
        if self.rng_state is not None:
            set_rng_states(self.rng_state, self.device)

    # -- where to go on from ---------------------------------------------------------------
    @property
    def start_epoch(self) -> int:
        if not self.latest:
            return 0
        epoch = int(self.latest.epoch or 0)
        return epoch + 1 if self.latest.epoch_complete else epoch

    @property
    def resume(self) -> dict | None:
        if not self.latest:
            return None
        return {"epoch": self.latest.epoch, "step": self.latest.step, "epoch_complete": self.latest.epoch_complete,
                "checkpoint": self.latest.n}

    # -- saving ------------------------------------------------------------------------------
    @property
    def format(self) -> CheckpointFormat:
        return files_of.format_for(self.parallelism)

    def _upload(self, n: int, path: str) -> str:
        name = os.path.basename(path)
        self.reporter.upload(f"checkpoints/{n}/{name}", path)
        return name

    def save(self, epoch: int, step: int, epoch_complete: bool = True) -> int:
        """Every rank calls it at the same point. Returns the checkpoint's number at once: training
        waits only for the previous checkpoint's upload, if still going, and for the copy of this
        one's tensors off the device; the files are written, uploaded and (rank 0, once every
        rank's are up) committed in the background. A failure there fails the rank at its next
        ``save`` or ``wait``; a rank lost before the commit leaves the previous checkpoint the
        latest. A rank outside the checkpoint's world (a DILOCO worker but rank 0: the job's
        checkpoints are rank 0's alone, a world of one), or one that does not write (a shadow),
        skips it."""
        n = self.next_n
        self.next_n += 1
        if self.rank >= self.world or not self.writes:
            return n
        self.wait()
        started = time.monotonic()
        folder = tempfile.mkdtemp(prefix=f"zwdx-ckpt-{n}-r{self.rank}-")
        try:
            write = self._stage_shards() if self.format == CheckpointFormat.SHARDS else self._stage_torch(folder)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        self.stall = time.monotonic() - started
        self._pending = threading.Thread(target=self._finish, args=(n, folder, write, started, epoch, step, epoch_complete),
                                         name=f"zwdx-checkpoint-{n}", daemon=True)
        self._pending.start()
        return n

    def wait(self) -> None:
        """Until the checkpoint in the background is uploaded and committed; its failure, raised."""
        if self._pending is not None:
            self._pending.join()
            self._pending = None
        if self._failed is not None:
            exc, self._failed = self._failed, None
            raise RuntimeError(f"checkpoint upload failed: {type(exc).__name__}: {exc}") from exc

    def _finish(self, n: int, folder: str, write, started: float, epoch: int, step: int,
                epoch_complete: bool) -> None:
        """The background half of ``save``: write, upload, and (rank 0) commit checkpoint ``n``."""
        try:
            write(folder)
            mine = [self._upload(n, os.path.join(folder, f)) for f in sorted(os.listdir(folder))]
            if self.rank == 0:
                names = sorted(files_of.required(self.format, self.world) | set(mine))
                self._commit(n, names, epoch=epoch, step=step, format=self.format.value, epoch_complete=epoch_complete)
                self.reporter.log(f"checkpoint {n} saved (epoch {epoch}, step {step}): training waited "
                                  f"{self.stall:.2f} s for it, {time.monotonic() - started:.2f} s to commit")
            log.info("rank %d: checkpoint %d saved (epoch %d, step %d)", self.rank, n, epoch, step)
        except BaseException as exc:  # raised in the training thread at its next save or wait
            self._failed = exc
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _commit(self, n: int, names: list[str], **fields) -> None:
        """Rank 0's commit, once the other ranks' files are up: no barrier (training goes on), so
        the server's answer that some are not yet there is waited out, up to the collective
        timeout; any other refusal is raised."""
        deadline, delay = time.monotonic() + self.commit_timeout, 0.05
        while True:
            try:
                return self.reporter.commit_checkpoint(n, names, **fields)
            except requests.HTTPError as exc:
                if not _not_uploaded_yet(exc.response) or time.monotonic() > deadline:
                    raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _tracked(self) -> dict:
        return {key: obj.state_dict() for key, obj in self.tracked.items()}

    def _stage_torch(self, folder: str):
        """DDP: rank 0 the model and optimizer state and the tracked objects'; every rank its
        generators. The tracked state is written and checked here (small; a state the checkpoint
        cannot hold is the caller's error, raised now); the rest is staged (``Staging.stage_tree``)
        and copied to host buffers in the background."""
        files = {files_of.rng_file(self.rank): rng_states(self.device)}
        if self.rank == 0 or self.format == CheckpointFormat.STAGES:  # PIPELINE: every rank its stage
            files[self._state_file()] = self.staging.stage_tree({
                "model": self._module().state_dict(),
                "optimizer": self.optimizer.state_dict() if self.optimizer else None})
        if self.rank == 0:
            if self.tracked:
                path = os.path.join(folder, EXTRA)
                torch.save({"tracked": self._tracked()}, path)
                try:
                    plain_load(path)
                except Exception as exc:
                    raise TypeError(f"reporter.track: {_TRACKABLE}: {exc}") from None

        def write(into: str) -> None:
            for name, state in files.items():
                torch.save(state() if callable(state) else state, os.path.join(into, name))
        return write

    def _stage_shards(self):
        """FSDP: this rank's shards, its generators and (rank 0) the tracked objects' state,
        copied to host buffers; written as safetensors and JSON later."""
        from torch.distributed.checkpoint.state_dict import get_state_dict
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
        state = {"model": model_sd, "optim": optim_sd, "rng": rng_states(self.device)}
        if self.rank == 0 and self.tracked:
            state["tracked"] = self._tracked()
            try:
                shards.check(state["tracked"], "tracked")
            except TypeError as exc:
                raise TypeError(f"reporter.track: {_TRACKABLE}: {exc}") from None
        local: list[tuple[str, torch.Tensor]] = []
        encoded = shards.encode(state, self.rank, self.world, stage=lambda key, t: local.append((key, t)) or t)
        host = self.staging.stage(local)

        def write(into: str) -> None:
            encoded["tensors"] = dict(zip((k for k, _ in local), host()))
            shards.write(encoded, into)
        return write

    def restore(self) -> None:
        """Load the latest checkpoint into the wrapped model and the optimizer (collective for FSDP),
        and keep the tracked objects' state and this rank's generators for later. A checkpoint
        of another format than the job's, or without a file its format requires, is refused
        before anything of it is read."""
        entry = self.latest
        if not entry:
            return
        fmt, world = self.format, entry.world_size or 0
        if entry.format != fmt:
            raise ValueError(f"checkpoint {entry.n} is in the {entry.format.value!r} format; a {self.parallelism.value} "
                             f"job reads only {fmt.value!r} checkpoints (zwdx never reads 'dcp': its metadata is a "
                             f"pickle)")
        # torch: the generators of the ranks of this group (a DILOCO worker is a group of one: its
        # job's checkpoints are rank 0's alone)
        lacking = sorted(files_of.required(fmt, world if fmt == CheckpointFormat.SHARDS else min(world, self.world))
                         - set(entry.files))
        if world < 1 or lacking:
            raise ValueError(f"checkpoint {entry.n} lacks {', '.join(lacking) or 'its world size'}: it holds "
                             f"{files_of.describe(fmt, max(world, 1))}")
        folder = tempfile.mkdtemp(prefix=f"zwdx-restore-{entry.n}-r{self.rank}-")
        try:
            if fmt == CheckpointFormat.SHARDS:
                self._restore_shards(entry, folder)
            else:
                self._restore_torch(entry, folder)
            log.info("rank %d: restored checkpoint %d (epoch %s, step %s)", self.rank, entry.n, entry.epoch,
                     entry.step)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _fetch(self, entry: CheckpointEntry, folder: str, name: str) -> str:
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            self.reporter.download(f"checkpoints/{entry.n}/{name}", path)
        return path

    def _module(self):
        """The user's module inside DDP's wrapper; a PIPELINE stage's module is its own."""
        return self.model if self.format == CheckpointFormat.STAGES else getattr(self.model, "module", self.model)

    def _state_file(self) -> str:
        """The file of the model and optimizer state this rank writes and reads: DDP's one
        ``state.pt`` (rank 0's), or (PIPELINE) its own stage's."""
        return files_of.stage_file(self.rank) if self.format == CheckpointFormat.STAGES else files_of.STATE

    def _restore_torch(self, entry: CheckpointEntry, folder: str) -> None:
        name = self._state_file()
        state = plain_load(self._fetch(entry, folder, name), self.device)
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict) or \
                not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state["model"].items()) or \
                not isinstance(state.get("optimizer"), (dict, type(None))):
            raise ValueError(f"checkpoint {entry.n}: {name} is not a model and optimizer state")
        self._module().load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer"):
            self.optimizer.load_state_dict(state["optimizer"])
        if EXTRA in entry.files:
            extra = plain_load(self._fetch(entry, folder, EXTRA))
            if not isinstance(extra, dict) or not isinstance(extra.get("tracked"), dict):
                raise ValueError(f"checkpoint {entry.n}: {EXTRA} is not the tracked objects' state")
            self.tracked_state = extra["tracked"]
        rng = files_of.rng_file(self.rank)
        if rng in entry.files:
            self.rng_state = _rng_checked(plain_load(self._fetch(entry, folder, rng)), entry.n)

    def _restore_shards(self, entry: CheckpointEntry, folder: str) -> None:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        world = entry.world_size
        indexes = [shards.read_index(self._fetch(entry, folder, files_of.shard_files(r)[1]), r, world)
                   for r in range(world)]
        reader = shards.Reader(indexes, lambda r: self._fetch(entry, folder, files_of.shard_files(r)[0]), self.rank)
        try:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
            model_sd = reader.value("model", model_sd)
            optim_sd = reader.value("optim", optim_sd) if self.optimizer is not None else {}
            if not isinstance(model_sd, dict) or not isinstance(optim_sd, (dict, type(None))):
                raise ValueError(f"checkpoint {entry.n} holds no model and optimizer state")
            set_state_dict(self.model, self.optimizer or [], model_state_dict=model_sd, optim_state_dict=optim_sd or {})
            if self.rank < world and reader.has("rng", self.rank):
                self.rng_state = _rng_checked(reader.value("rng", rank=self.rank), entry.n)
            tracked = reader.value("tracked", rank=0) if reader.has("tracked", 0) else None
            if not isinstance(tracked, (dict, type(None))):
                raise ValueError(f"checkpoint {entry.n}: rank 0's tracked state is no dict")
            self.tracked_state = tracked or {}
        finally:
            reader.close()


_TRACKABLE = ("a tracked object's state_dict() holds something other than tensors, numbers, strings and lists, "
              "tuples or dicts of them")


@contextlib.contextmanager
def _torch_allowlist_only():
    """``torch.load(weights_only=True)`` with torch's own allowlist only, not the globals a library
    or the job's code added (``torch.serialization.add_safe_globals``): those come back after."""
    added = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        yield
    finally:
        torch.serialization.add_safe_globals(added)


def _not_uploaded_yet(resp) -> bool:
    """Whether the server refused a commit only because files it names are not uploaded yet."""
    try:
        error = resp.json().get("error", {})
    except (ValueError, AttributeError):
        return False
    return resp.status_code == 400 and error.get("field") == "files" and bool(error.get("missing"))


def plain_load(path: str, device="cpu"):
    """A file a rank wrote with ``torch.save``, read as data only: ``weights_only=True`` with
    torch's own allowlist (tensors, numbers, strings, lists, tuples, dicts), nothing else."""
    with _torch_allowlist_only():
        return torch.load(path, map_location=device, weights_only=True)


def _rng_checked(state, n: int) -> dict:
    if not isinstance(state, dict) or not isinstance(state.get("python"), (tuple, list)) or \
            not isinstance(state.get("torch"), torch.Tensor):
        raise ValueError(f"checkpoint {n}: a rank's generators are not the state zwdx saves")
    return state


def rng_states(device) -> dict:
    """This process's random number generators: Python's, torch's (CPU, and the rank's GPU),
    numpy's if it is installed; all as plain values and tensors (``weights_only`` loads them)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def set_rng_states(state: dict, device) -> None:
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
    if "numpy" in state:
        try:
            import numpy as np
        except ImportError:
            return
        s = state["numpy"]
        np.random.set_state((s["kind"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"],
                             s["cached_gaussian"]))
