"""Checkpoints of a job, written and read by its ranks through the server's artifact store.

DDP: rank 0 saves the model and optimizer state as one file (``torch.save``; read back with
``weights_only=True``). FSDP: ``torch.distributed.checkpoint`` writes one shard per rank and
rank 0 the metadata, with no full gather on one rank; each rank uploads its own files, and a
resumed job (possibly of another world size) downloads them all and lets DCP reshard.
Rank 0 commits a checkpoint once every rank has uploaded; the server keeps the last N.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

import torch
import torch.distributed as dist

from zwdx import defaults

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, reporter, model, optimizer, parallelism: str, rank: int, world: int, device,
                 latest: dict | None = None):
        self.reporter, self.model, self.optimizer = reporter, model, optimizer
        self.parallelism, self.rank, self.world, self.device = parallelism, rank, world, device
        self.latest = latest
        self.next_n = (latest["n"] + 1) if latest else 0
        self.saved = 0

    # -- where to go on from ---------------------------------------------------------------
    @property
    def start_epoch(self) -> int:
        if not self.latest:
            return 0
        epoch = int(self.latest.get("epoch") or 0)
        return epoch + 1 if self.latest.get("epoch_complete", True) else epoch

    @property
    def resume(self) -> dict | None:
        if not self.latest:
            return None
        return {"epoch": self.latest.get("epoch"), "step": self.latest.get("step"),
                "epoch_complete": self.latest.get("epoch_complete", True), "checkpoint": self.latest["n"]}

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
            if self.parallelism == "FSDP":
                import torch.distributed.checkpoint as dcp
                from torch.distributed.checkpoint.state_dict import get_state_dict
                model_sd, optim_sd = get_state_dict(self.model, self.optimizer or [])
                dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp.FileSystemWriter(folder))
                mine = [self._upload(n, os.path.join(folder, f)) for f in sorted(os.listdir(folder))]
                everyone: list = [None] * self.world
                dist.all_gather_object(everyone, mine)
                names = sorted({name for names in everyone for name in names})
                fmt = "dcp"
            else:
                names, fmt = ["state.pt"], "torch"
                if self.rank == 0:
                    state = {"model": self.model.module.state_dict(),
                             "optimizer": self.optimizer.state_dict() if self.optimizer else None}
                    torch.save(state, os.path.join(folder, "state.pt"))
                    self._upload(n, os.path.join(folder, "state.pt"))
            dist.barrier()  # every rank's files are in the artifact store
            if self.rank == 0:
                self.reporter.flush()
                resp = self.reporter.session.post(f"{self.reporter.base}/checkpoints/{n}/commit", timeout=60, json={
                    "files": names, "epoch": epoch, "step": step, "format": fmt, "epoch_complete": epoch_complete})
                resp.raise_for_status()
            self.saved += 1
            log.info("rank %d: checkpoint %d saved (epoch %d, step %d)", self.rank, n, epoch, step)
            return n
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    # -- restoring ---------------------------------------------------------------------------
    def restore(self) -> None:
        """Load the latest checkpoint into the wrapped model and the optimizer (collective for FSDP)."""
        entry = self.latest
        if not entry:
            return
        folder = tempfile.mkdtemp(prefix=f"zwdx-restore-{entry['n']}-r{self.rank}-")
        try:
            for name in entry["files"]:
                url = f"{self.reporter.base}/checkpoints/{entry['n']}/{name}"
                with self.reporter.session.get(url, stream=True, timeout=600) as resp:
                    resp.raise_for_status()
                    with open(os.path.join(folder, name), "wb") as fh:
                        for block in resp.iter_content(defaults.CHUNK_BYTES):
                            fh.write(block)
            if entry.get("format") == "dcp":
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
            log.info("rank %d: restored checkpoint %d (epoch %s, step %s)", self.rank, entry["n"],
                     entry.get("epoch"), entry.get("step"))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
