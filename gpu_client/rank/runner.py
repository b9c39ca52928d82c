"""One rank of one job, in its own process (started by the agent's launcher, one per slot).

``gpu_client.sandbox.rank_process`` (or, in a container, ``rank_container``) reads the rank's
``RankSpec``, enters the job's sandbox and runs ``rank_for(spec)``: this module knows its spec
only, not who started it or how it is confined. A script job's rank runs
``gpu_client.rank.script.ScriptRank`` instead (``rank_for``).

``Trainer`` has torchtitan's shape: ``setup`` joins the process group (NCCL on CUDA, gloo on CPU
and on mixed devices, the job's collective timeout) while the bundle loads, makes the loaders,
wraps the model (the job's strategy: DDP/FSDP, a pipeline stage, a DILOCO worker, a replica of
a mixed-devices job), tells the server what the rank holds of it (``strategy.layout``: the
job's page draws it), rebuilds the optimizer and
restores the checkpoint; ``train`` calls the user's
``train_func`` with the arguments it declares; ``finish`` runs ``eval_func``, gathers the
weights, uploads them from rank 0 and reports the result. A failure is reported with its
traceback, and whether the rank's own code raised or it lost its peers (``failures.py``),
before the process exits non-zero.
"""
from __future__ import annotations

import inspect
import io
import logging
import os
import sys
import tempfile
import threading
import time
import traceback

from zwdx.bundle import load as load_bundle
from zwdx.bundle import FETCH_FAILED, register_sources
from zwdx.model_rules import call_with
from zwdx.protocol.rank import RankSpec
from zwdx.protocol.vocab import JobKind, Parallelism, RankStatus

from .failures import MissingPackage, is_collective_error, missing_package
from .metrics import CountingLoader, SystemMetrics
from .reporter import Reporter
from .tuning import DEFAULT_TUNING, Tuning

log = logging.getLogger("gpu_client.rank.runner")


class Trainer:
    """One rank of one job: ``setup``, ``train``, ``finish``; ``run`` does the three and reports."""

    def __init__(self, spec: RankSpec, tuning: Tuning = DEFAULT_TUNING):
        self.spec, self.tuning = spec, tuning
        self.startup = Startup(spec.assigned_at)
        self.startup.mark("rank_process")
        self.reporter = Reporter(spec.server, spec.rank_key.get_secret_value(), spec.job_id, spec.own_rank,
                                 attempt=spec.attempt, verify=spec.ca_file or True, patience=spec.outage_tolerance)
        self.joined = False
        self.system: SystemMetrics | None = None
        from gpu_client.rank.strategies.registry import strategy
        self.strategy = strategy(spec, self.reporter, tuning)  # DDP/FSDP, or DILOCO: where the ways to train differ

    def run(self) -> int:
        """The rank, start to end: 0 when it completed, 1 when it failed (and said why)."""
        sys.stdout = LogTee(sys.stdout, self.reporter)
        try:
            self.setup()
            self.finish(self.train())
            return 0
        except BaseException as exc:  # report every failure, then exit non-zero
            self.fail(exc)
            return 1
        finally:
            self.close()

    # -- setup -----------------------------------------------------------------------------------
    def setup(self) -> None:
        import torch
        torch.set_num_threads(self.spec.threads)
        os.environ.update(self.spec.torch_environ())  # for libraries that read torch's variables
        bundle = BundleLoader(self.spec.bundle_path, self.spec.bundle_sha256, self.spec.bundle_pending, self.startup,
                              self.spec.bundle_size,
                              self.spec.where)
        bundle.start()
        self.device = self._join()
        self.bundle = bundle.result()
        seed(self.spec.job.training.seed)  # before the loaders and the model's wrapping draw from them
        self.reporter.status(RankStatus.RUNNING.value)
        self.loaders = self._user_loaders()
        self.model, self.optimizer = self._build()
        self._layout()
        self.checkpointer = self._restore()
        self.strategy.attach(self.model, self.checkpointer)
        self.loader, self.eval_loader = self._loaders()

    def _join(self):
        """Join the job's process group (while the bundle loads): ``rendezvous.join``."""
        import torch

        from .rendezvous import join
        spec, device = self.spec, torch.device(self.spec.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        join(self.strategy.rendezvous(), spec.backend, device, spec.collective_timeout, self.startup.mark, self.tuning)
        self.joined = True
        return device

    def _build(self):
        """The user's model on this rank's device, wrapped; the optimizer over its parameters."""
        from gpu_client.rank.strategies.parallel import rebuild_optimizer
        model = self.strategy.wrap(self.bundle["model"], self.device, self.bundle, self.reporter.log,
                                   example=lambda: first_batch(self.loaders[0]))
        self.startup.mark("wrapped")
        return model, rebuild_optimizer(self.bundle["optimizer"], model, part=self.strategy.part)

    def _layout(self) -> None:
        """Tell the server what this rank holds of the wrapped model (the strategy's ``layout``):
        the job's page draws it. It only describes, so a failure to make it is logged, not raised."""
        try:
            layout = self.strategy.layout(self.model)
        except Exception:
            log.warning("rank %d: could not describe its layout", self.spec.rank, exc_info=True)
            return
        self.reporter.send_layout(layout)

    def _restore(self):
        """The job's Checkpointer, with the checkpoint this attempt goes on from loaded."""
        import torch.distributed as dist

        from .checkpoint import Checkpointer
        spec, latest = self.spec, self.spec.checkpoint
        # A shadow restores as the worker it runs again (``spec.rank``: the worker's generators
        # too, or its steps after a resume would differ from the worker's and name an honest
        # worker), in the workers' world (a DDP shadow's own group is a world of one), and writes
        # no checkpoint.
        world = 1 if spec.parallelism == Parallelism.DILOCO else \
            spec.world_size if spec.shadow is not None else dist.get_world_size()
        checkpointer = Checkpointer(self.reporter, self.model, self.optimizer, self.strategy.wrap_as, spec.rank, world,
                                    self.device, latest, commit_timeout=spec.collective_timeout,
                                    writes=spec.shadow is None)
        if latest is not None and spec.joining:
            pass  # a DILOCO worker joining: the epoch to go on from, but its weights come from a worker
        elif latest is not None:
            checkpointer.restore()
            if spec.rank == 0:
                self.reporter.log(f"resumed from checkpoint {latest.n} (epoch {latest.epoch}, step {latest.step})")
        self.startup.mark("optimizer_checkpoint")
        return checkpointer

    def _user_loaders(self):
        """``data_loader_func``'s training and eval loaders (one loader: both). A pipeline's
        stages are one replica: each is told rank 0 of 1 (``strategy.loader_arguments``); a
        mixed-devices rank is told its share of the global batch (``strategy.loaders``)."""
        loaders = self.strategy.loaders(self._call_loader, self.bundle, self.device)
        self.startup.mark("data_loader")
        return loaders

    def _call_loader(self, arguments: dict):
        loaders = call_with(self.bundle["data_loader_func"], {**arguments, "device": self.device,
                                                              "data_dir": self.spec.data_dir}, "data_loader_func")
        return loaders if isinstance(loaders, tuple) and len(loaders) == 2 else (loaders, loaders)

    def _loaders(self):
        """The training loader counts samples, and ends epochs with a checkpoint. A resumed
        rank's generators go back where the checkpoint found them: where it was taken, as the
        loader's next pass starts (and before train_func, for code that ignores the loader)."""
        train_loader, eval_loader = self.loaders
        loader = CountingLoader(self.strategy.train_loader(train_loader), self.model,
                                self._epoch_end if self.spec.checkpoint_every_epoch else None,
                                on_first_step=self._first_step, on_first_pass=self.checkpointer.restore_rng)
        self.reporter.attach(self.checkpointer, loader)
        replicas = self.strategy.replicas()  # a pipeline is one; mixed devices: the global batch over rank 0's
        self.system = SystemMetrics(self.reporter, loader, self.spec.rank, replicas, self.device)
        return loader, eval_loader

    def _epoch_end(self, passes: int) -> None:
        self.checkpointer.save(self.reporter.start_epoch + passes - 1, self.reporter.step)

    def _first_step(self) -> None:
        self.system.first_step()

    # -- train -----------------------------------------------------------------------------------
    def train(self):
        """The user's train_func; returns what it returned."""
        spec, reporter = self.spec, self.reporter
        self.startup.mark("train_func")
        if spec.rank == 0:
            reporter.log(self.startup.line())
        self.checkpointer.restore_rng()
        if self.system.needed:
            self.system.start()
        train_func = self.bundle["train_func"]
        out = call_with(train_func, {
            "model": self.model, "loader": self.loader, "optimizer": self.optimizer, "optim": self.optimizer,
            "rank": spec.rank, "world_size": spec.world_size, **epochs_argument(spec.epochs, train_func),
            "device": self.device, "eval_func": self.bundle["eval_func"], "reporter": reporter,
            "start_epoch": reporter.start_epoch, "resume": reporter.resume, **self.strategy.train_arguments()},
            "train_func")
        self.system.finish()
        self.strategy.trained()  # DILOCO: the last outer step
        self.loader.finish()  # the last epoch's checkpoint, now that train_func is done with it
        return out

    # -- finish ----------------------------------------------------------------------------------
    def finish(self, train_out) -> None:
        """eval_func, the weights (uploaded by rank 0), and the rank's result."""
        import torch.distributed as dist

        from gpu_client.rank.strategies.lora import returned_state
        from gpu_client.rank.strategies.parallel import fingerprint
        spec, eval_func = self.spec, self.bundle["eval_func"]
        self.strategy.sync_buffers(self.model)  # rank 0's buffers on every rank, for eval_func and the weights
        eval_out = None
        if eval_func is not None:
            evaluated = self.strategy.evaluated(self.model, self.device)  # a pipeline's: the whole model, rank 0
            if evaluated is not None:
                model, device = evaluated
                eval_out = call_with(eval_func, {"model": model, "loader": self.eval_loader, "rank": spec.rank,
                                                 "world_size": spec.world_size, "device": device}, "eval_func")
        results, final_loss = _results(train_out, eval_out)
        state = returned_state(self.bundle["model"], self.strategy.full_state(self.model))  # LoRA: the adapter
        weights = _upload_weights(self.reporter, state) if self.strategy.uploads_weights() else None
        self.checkpointer.wait()  # the last checkpoint's upload, if still going
        dist.barrier()
        self.strategy.report_end(lambda: self.reporter.status(
            RankStatus.COMPLETED.value, results=results, final_loss=final_loss, fingerprint=fingerprint(state),
            weights_artifact=weights, global_fingerprint=self.strategy.global_fingerprint(self.model, state)))

    def fail(self, exc: BaseException) -> None:
        """Report the failure: the traceback, and whether the rank lost its peers (or, a step
        check's disagreement, the ``StepCheck``: not a lost peer)."""
        tb = "".join(traceback.format_exception(exc))
        sys.__stderr__.write(tb)
        if isinstance(exc, ImportError) and not isinstance(exc, MissingPackage):
            exc = missing_package(exc, self.spec.where)  # the job's code imported it as it ran
        check = self.strategy.failed_check()  # DDP with verify: what stopped it, whatever DDP made of the error
        how = {"collective": False, "check": check.model_dump(mode="json")} if check is not None else \
            {"collective": self.joined and is_collective_error(exc)}
        try:
            self.reporter.status(RankStatus.FAILED.value, error=f"{type(exc).__name__}: {exc}", traceback=tb, **how)
        except Exception:
            log.exception("could not report the failure")

    def close(self) -> None:
        if self.system is not None:
            self.system.finish(sample=False)
        sys.stdout = sys.__stdout__
        self.reporter.close()
        if self.joined:
            try:
                import torch.distributed as dist
                dist.destroy_process_group()
            except Exception:
                pass


class LogTee(io.TextIOBase):
    """Copies what the user's code prints into the job's log, line by line."""

    def __init__(self, stream, reporter: Reporter):
        self._stream, self._reporter, self._buf = stream, reporter, ""

    def write(self, text):
        self._stream.write(text)
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.strip():
                self._reporter.log(line)
        return len(text)

    def flush(self):
        self._stream.flush()


class Startup:
    """When each step of a rank's start happened, in seconds after the job reached the GPU
    client; rank 0 writes them to the job's log, so a slow start says where its time went."""

    def __init__(self, origin: float):
        self.origin = origin
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def line(self) -> str:
        return ("startup, seconds after the job reached this GPU client: "
                + " ".join(f"{name}={at - self.origin:.2f}" for name, at in self.marks))


class BundleLoader(threading.Thread):
    """Loads the job's bundle while the main thread joins the process group, if its bytes are
    the job's (``sha256``; checked on every load). While the GPU client is still fetching it
    (``pending``), a line on stdin says it has arrived (end of input: it could not be fetched);
    with ``size`` the bundle is read and hashed as the GPU client writes it, and that line is
    still waited for before the bundle is handed over (the job's datasets come before it)."""

    def __init__(self, path: str, sha256: str, pending: bool, startup: Startup, size: int | None, where: str):
        super().__init__(name="zwdx-bundle", daemon=True)
        self.path, self.sha256, self.pending, self.startup, self.where = path, sha256, pending, startup, where
        self.size = size if pending else None
        self.word: bool | None = None if pending else True  # the agent's: ready (True), could not fetch (False)
        self._heard = threading.Event()
        self.bundle: dict | None = None
        self.error: BaseException | None = None

    def _listen(self) -> None:
        self.word = bool(sys.stdin.readline().strip())
        self._heard.set()

    def _arrived(self, wait: bool = False) -> bool | None:
        """The agent's word on stdin, once it came (``wait``: until it comes)."""
        if wait:
            self._heard.wait()
        return self.word

    def run(self) -> None:
        if self.word is None:  # a line on stdin is awaited beside the reading (its buffer is stdin's own)
            threading.Thread(target=self._listen, name="zwdx-bundle-word", daemon=True).start()
        else:
            self._heard.set()
        try:
            if self.size is None and not self._arrived(wait=True):
                raise RuntimeError(FETCH_FAILED)
            self.startup.mark("bundle_fetched")
            try:
                self.bundle = load_bundle(self.path, self.sha256, self.size, self._arrived)
            except ImportError as exc:
                raise missing_package(exc, self.where) from exc
            if not self._arrived(wait=True):  # read whole already; the datasets may still be on their way
                raise RuntimeError("the GPU client could not make the job's files ready")
            register_sources(self.bundle["sources"])
            self.startup.mark("bundle_loaded")
        except BaseException as exc:  # re-raised in the main thread
            self.error = exc

    def result(self) -> dict:
        self.join()
        if self.error is not None:
            raise self.error
        return self.bundle


def seed(value: int | None) -> None:
    """The job's ``training.seed``: torch (CPU and CUDA), ``random`` and numpy seeded alike on
    every rank; None: left as the process has them."""
    if value is None:
        return
    import random

    import numpy
    import torch
    random.seed(value)
    numpy.random.seed(value)
    torch.manual_seed(value)


def first_batch(loader):
    """The loader's first batch, drawn without moving the generators the job's training uses."""
    import torch
    with torch.random.fork_rng(devices=[]):
        return next(iter(loader))


def epochs_argument(epochs: int | None, train_func) -> dict:
    """``{"epochs": n}`` as submitted; none given: ``{}`` if train_func has a default for it
    (its own default wins), else 1."""
    if epochs is not None:
        return {"epochs": epochs}
    declared = inspect.signature(train_func).parameters.get("epochs")
    return {} if declared is not None and declared.default is not declared.empty else {"epochs": 1}


def _results(train_out, eval_out) -> tuple[dict, float | None]:
    results: dict = {}
    final_loss = None
    if isinstance(train_out, dict):
        results.update({k: _plain(v) for k, v in train_out.items()})
        final_loss = results.get("final_loss", results.get("loss"))
    elif train_out is not None:
        final_loss = _plain(train_out)
    if isinstance(eval_out, dict):
        results.update({k: _plain(v) for k, v in eval_out.items()})
    elif isinstance(eval_out, (tuple, list)):
        results["eval"] = [_plain(v) for v in eval_out]
    elif eval_out is not None:
        results["eval"] = _plain(eval_out)
    if final_loss is not None:
        results["final_loss"] = final_loss
    return results, final_loss


def _plain(value):
    if hasattr(value, "item") and getattr(value, "numel", lambda: 1)() == 1:
        return value.item()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):  # nested results stay a mapping (keys as strings, as JSON has them)
        return {str(k): _plain(v) for k, v in value.items()}
    return repr(value)


def _upload_weights(reporter: Reporter, state: dict) -> str:
    from safetensors.torch import save_file
    fd, path = tempfile.mkstemp(suffix=".safetensors")
    os.close(fd)
    try:
        save_file({k: v.contiguous().clone() for k, v in state.items()}, path)
        return reporter.upload("weights", path)["id"]
    finally:
        os.unlink(path)


def rank_for(spec: RankSpec, tuning: Tuning = DEFAULT_TUNING):
    """How this rank runs, chosen from its spec: the submitter's functions (``Trainer``), or a
    script under torchrun's environment (``gpu_client.rank.script``). Each has ``run() -> exit code``."""
    if spec.kind == JobKind.SCRIPT:
        from .script import ScriptRank
        return ScriptRank(spec)
    return Trainer(spec, tuning)

