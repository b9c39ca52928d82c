"""Checkpoints of a job, written and read by its ranks through the server's artifact store.

DDP: rank 0 saves the model and optimizer state as one file (``torch.save``; read back with
``weights_only=True``). FSDP: ``torch.distributed.checkpoint`` writes one shard per rank and
rank 0 the metadata, with no full gather on one rank; each rank uploads its own files, and a
resumed job (possibly of another world size) downloads them all and lets DCP reshard.
Rank 0 commits a checkpoint once every rank has uploaded; the server keeps the last N.

Beside the model: ``extra.pt`` (rank 0) holds the state of the objects ``train_func`` gave to
``reporter.track`` (LR scheduler, GradScaler, its own), restored as each is tracked again on
resume; ``rng-<rank>.pt`` each rank's random number generators (Python, torch, CUDA where used,
numpy), restored on the same rank. Every file is read with ``weights_only=True``.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile

import torch
import torch.distributed as dist

from zwdx.protocol.job import CheckpointEntry
from zwdx.protocol.vocab import CheckpointFormat, Parallelism

log = logging.getLogger(__name__)

#: The file of a checkpoint that holds the tracked objects' state (written by rank 0).
EXTRA = "extra.pt"


class Checkpointer:
    def __init__(self, reporter, model, optimizer, parallelism: Parallelism, rank: int, world: int, device,
                 latest: CheckpointEntry | None = None):
        self.reporter, self.model, self.optimizer = reporter, model, optimizer
        self.parallelism, self.rank, self.world, self.device = parallelism, rank, world, device
        self.latest = latest  # the checkpoint this attempt goes on from
        self.next_n = (latest.n + 1) if latest else 0
        self.tracked: dict[str, object] = {}  # name -> object with state_dict()/load_state_dict()
        self.tracked_state: dict = {}         # name -> its state in the checkpoint restored
        self.rng_state: dict | None = None    # this rank's generators in the checkpoint restored

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
    def _upload(self, n: int, path: str) -> str:
        name = os.path.basename(path)
        self.reporter.upload(f"checkpoints/{n}/{name}", path)
        return name

    def save(self, epoch: int, step: int, epoch_complete: bool = True) -> int:
        """Collective: every rank calls it at the same point. Returns the checkpoint number."""
        n = self.next_n
        self.next_n += 1
        folder = tempfile.mkdtemp(prefix=f"zwdx-ckpt-{n}-r{self.rank}-")
        try:
            if self.parallelism == Parallelism.FSDP:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict
                model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
                dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(folder))
                fmt = CheckpointFormat.DCP
            else:
                fmt = CheckpointFormat.TORCH
                if self.rank == 0:
                    state = {"model": self.model.module.state_dict(),
                             "optimizer": self.optimizer.state_dict() if self.optimizer else None}
                    torch.save(state, os.path.join(folder, "state.pt"))
            self._save_extra(folder)
            mine = [self._upload(n, os.path.join(folder, f)) for f in sorted(os.listdir(folder))]
            everyone: list = [None] * self.world
            dist.all_gather_object(everyone, mine)  # also: every rank's files are in the artifact store
            names = sorted({name for names in everyone for name in names})
            if self.rank == 0:
                self.reporter.commit_checkpoint(n, names, epoch=epoch, step=step, format=fmt.value,
                                                epoch_complete=epoch_complete)
            log.info("rank %d: checkpoint %d saved (epoch %d, step %d)", self.rank, n, epoch, step)
            return n
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _save_extra(self, folder: str) -> None:
        """Rank 0: the tracked objects' state (``extra.pt``); every rank: its generators."""
        if self.rank == 0 and self.tracked:
            path = os.path.join(folder, EXTRA)
            torch.save({"tracked": {key: obj.state_dict() for key, obj in self.tracked.items()}}, path)
            try:
                torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:
                raise TypeError("reporter.track: a tracked object's state_dict() holds something other than "
                                f"tensors, numbers, strings and lists, tuples or dicts of them: {exc}") from None
        torch.save(rng_states(self.device), os.path.join(folder, f"rng-{self.rank}.pt"))

    # -- restoring ---------------------------------------------------------------------------
    def restore(self) -> None:
        """Load the latest checkpoint into the wrapped model and the optimizer (collective for FSDP),
        and keep the tracked objects' state and this rank's generators for later."""
        entry = self.latest
        if not entry:
            return
        folder = tempfile.mkdtemp(prefix=f"zwdx-restore-{entry.n}-r{self.rank}-")
        rng = f"rng-{self.rank}.pt"
        try:
            for name in entry.files:
                if name.startswith("rng-") and name != rng:
                    continue  # another rank's generators
                self.reporter.download(f"checkpoints/{entry.n}/{name}", os.path.join(folder, name))
            if entry.format == CheckpointFormat.DCP:
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
                model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
                state = {"model": model_sd, "optim": optim_sd}
                dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
                set_state_dict(self.model, self.optimizer or [], model_state_dict=state["model"],
                               optim_state_dict=state["optim"])
            else:
                state = torch.load(os.path.join(folder, "state.pt"), map_location=self.device, weights_only=True)
                target = self.model.module if hasattr(self.model, "module") else self.model
                target.load_state_dict(state["model"])
                if self.optimizer is not None and state.get("optimizer"):
                    self.optimizer.load_state_dict(state["optimizer"])
            if EXTRA in entry.files:
                extra = torch.load(os.path.join(folder, EXTRA), map_location="cpu", weights_only=True)
                self.tracked_state = extra.get("tracked") or {}
            if rng in entry.files:
                self.rng_state = torch.load(os.path.join(folder, rng), map_location="cpu", weights_only=True)
            log.info("rank %d: restored checkpoint %d (epoch %s, step %s)", self.rank, entry.n, entry.epoch,
                     entry.step)
        finally:
            shutil.rmtree(folder, ignore_errors=True)


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
    random.setstate(state["python"])
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
