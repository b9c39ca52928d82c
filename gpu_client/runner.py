"""One rank of one job, in its own process (started by the agent, one per slot).

    python -m gpu_client.runner      # everything comes from ZWDX_* and torch's env variables

Steps: load the bundle, join the process group (NCCL on CUDA, gloo on CPU, bounded timeout),
wrap the model (DDP/FSDP), rebuild the optimizer, call the user's functions with the
arguments they declare, gather the weights, upload them from rank 0, report the result.
A failure is reported with its traceback before the process exits non-zero.
"""
from __future__ import annotations

import datetime
import inspect
import io
import json
import logging
import os
import sys
import tempfile
import threading
import time
import traceback

from zwdx import defaults
from zwdx.bundle import register_sources
from zwdx.checks import call_with
from zwdx.bundle import load as load_bundle

from .metrics import CountingLoader, SystemMetrics
from .reporter import Reporter

log = logging.getLogger("gpu_client.runner")


class _LogTee(io.TextIOBase):
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


def _is_collective_error(exc: BaseException) -> bool:
    """True when the error came from torch.distributed: a peer is probably gone."""
    import torch.distributed as dist
    kinds = tuple(k for k in (getattr(dist, n, None) for n in ("DistError", "DistBackendError", "DistNetworkError",
                                                               "DistStoreError")) if isinstance(k, type))
    if kinds and isinstance(exc, kinds):
        return True
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(s in text for s in ("connection closed by peer", "connection reset", "broken pipe", "gloo",
                                   "nccl", "timed out", "socket", "connection refused"))


def _epochs(value: str | None, train_func) -> dict:
    """``{"epochs": n}`` as submitted; none given: ``{}`` if train_func has a default for it
    (its own default wins), else 1."""
    if value:
        return {"epochs": int(value)}
    declared = inspect.signature(train_func).parameters.get("epochs")
    return {} if declared is not None and declared.default is not declared.empty else {"epochs": 1}


class MissingPackage(ImportError):
    """The job's code imports a package that this GPU client does not have (or has in a
    version without what the code needs)."""


def _missing_package(exc: ImportError, where: str) -> MissingPackage:
    if not exc.name:
        return MissingPackage(f"{where} cannot import what the job needs: {exc}")
    name = exc.name.split(".")[0]
    if isinstance(exc, ModuleNotFoundError):
        return MissingPackage(f"{where} lacks package '{name}' (No module named '{exc.name}'); "
                              f"install it there", name=name)
    return MissingPackage(f"{where} cannot import from package '{name}': {exc} (another version of it "
                          f"than the submitter's?)", name=name)


def _die_with_parent() -> None:
    """If the GPU client dies (SIGKILL, lost machine), its ranks die with it."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        if os.getppid() == 1:
            os._exit(1)
    except OSError:
        pass


class _Startup:
    """When each step of a rank's start happened, in seconds after the job reached the GPU
    client; rank 0 writes them to the job's log, so a slow start says where its time went."""

    def __init__(self, origin: str | None):
        self.origin = float(origin) if origin else time.time()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        self.marks.append((name, time.time()))

    def line(self) -> str:
        return ("startup, seconds after the job reached this GPU client: "
                + " ".join(f"{name}={at - self.origin:.2f}" for name, at in self.marks))


class _BundleLoader(threading.Thread):
    """Loads the job's bundle while the main thread joins the process group. With
    ZWDX_BUNDLE_PENDING=1 the GPU client is still fetching it: a line on stdin says it has
    arrived (end of input: it could not be fetched)."""

    def __init__(self, path: str, pending: bool, startup: _Startup, where: str):
        super().__init__(name="zwdx-bundle", daemon=True)
        self.path, self.pending, self.startup, self.where = path, pending, startup, where
        self.bundle: dict | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            if self.pending and not sys.stdin.readline().strip():
                raise RuntimeError("the GPU client could not fetch the job's bundle")
            self.startup.mark("bundle_fetched")
            try:
                self.bundle = load_bundle(self.path)
            except ImportError as exc:
                raise _missing_package(exc, self.where) from exc
            register_sources(self.bundle["sources"])
            self.startup.mark("bundle_loaded")
        except BaseException as exc:  # re-raised in the main thread
            self.error = exc

    def result(self) -> dict:
        self.join()
        if self.error is not None:
            raise self.error
        return self.bundle


def main() -> int:
    _die_with_parent()
    env = os.environ
    startup = _Startup(env.get("ZWDX_ASSIGNED_AT"))
    startup.mark("rank_process")
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s: %(message)s")
    reporter = Reporter(env["ZWDX_SERVER"], env["ZWDX_ROOM_TOKEN"], env["ZWDX_JOB_ID"], env["ZWDX_JOB_KEY"],
                        rank, attempt=int(env.get("ZWDX_ATTEMPT", "0")))
    where = f"gpu client {env.get('ZWDX_CLIENT_ID', '?')} on host {env.get('ZWDX_HOSTNAME', '?')}"
    sys.stdout = _LogTee(sys.stdout, reporter)
    joined = False
    code = 0
    system = None
    try:
        import torch
        import torch.distributed as dist

        from .parallel import fingerprint, full_state_dict, rebuild_optimizer, sync_buffers, wrap
        torch.set_num_threads(int(env.get("ZWDX_NUM_THREADS", "1")))
        bundle_loader = _BundleLoader(env["ZWDX_BUNDLE"], env.get("ZWDX_BUNDLE_PENDING") == "1", startup, where)
        bundle_loader.start()
        device = torch.device(env.get("ZWDX_DEVICE", "cpu"))
        if device.type == "cuda":
            torch.cuda.set_device(device)
        backend = env.get("ZWDX_BACKEND", "nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(seconds=float(env.get("ZWDX_COLLECTIVE_TIMEOUT", defaults.COLLECTIVE_TIMEOUT)))
        init = f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
        joined = True
        startup.mark("joined")
        bundle = bundle_loader.result()
        reporter.status("running")
        parallelism = env.get("ZWDX_PARALLELISM", "DDP")
        model = bundle["model"].to(device)
        startup.mark("on_device")
        model = wrap(model, parallelism, device, units=bundle.get("fsdp_units"), report=reporter.log)
        startup.mark("wrapped")
        optimizer = rebuild_optimizer(bundle["optimizer"], model)
        from .checkpoint import Checkpointer
        latest = json.loads(env.get("ZWDX_CHECKPOINT") or "null")
        ckpt = Checkpointer(reporter, model, optimizer, parallelism, rank, world, device, latest)
        if latest:
            ckpt.restore()
            reporter.start_epoch, reporter.resume = ckpt.start_epoch, ckpt.resume
            reporter.step = int(latest.get("step") or 0)
            if rank == 0:
                reporter.log(f"resumed from checkpoint {latest['n']} (epoch {latest.get('epoch')}, "
                             f"step {latest.get('step')})")
        reporter._checkpointer = ckpt
        startup.mark("optimizer_checkpoint")
        loaders = call_with(bundle["data_loader_func"], {"rank": rank, "world_size": world, "device": device},
                            "data_loader_func")
        train_loader, eval_loader = (loaders if isinstance(loaders, tuple) and len(loaders) == 2
                                     else (loaders, loaders))
        startup.mark("data_loader")

        def epoch_end(passes: int) -> None:
            ckpt.save(reporter.start_epoch + passes - 1, reporter.step)
        every_epoch = env.get("ZWDX_CHECKPOINT_EVERY_EPOCH", "1") == "1"
        # a resumed rank's generators go back where the checkpoint found them: where it was taken,
        # as the loader's next pass started (and before train_func, for code that ignores the loader)
        loader = CountingLoader(train_loader, model, epoch_end if every_epoch else None,
                                on_first_step=lambda: system.first_step(), on_first_pass=ckpt.restore_rng)
        reporter._loader = loader
        system = SystemMetrics(reporter, loader, rank, world, device)
        eval_func = bundle["eval_func"]
        startup.mark("train_func")
        if rank == 0:
            reporter.log(startup.line())
        ckpt.restore_rng()
        if system.needed:
            system.start()
        train_out = call_with(bundle["train_func"], {
            "model": model, "loader": loader, "optimizer": optimizer, "optim": optimizer, "rank": rank,
            "world_size": world, **_epochs(env.get("ZWDX_EPOCHS"), bundle["train_func"]), "device": device,
            "eval_func": eval_func, "reporter": reporter, "start_epoch": reporter.start_epoch,
            "resume": reporter.resume}, "train_func")
        system.finish()
        loader.finish()  # the last epoch's checkpoint, now that train_func is done with it
        sync_buffers(model)  # rank 0's buffers on every rank, for eval_func and the weights
        eval_out = None
        if eval_func is not None:
            eval_out = call_with(eval_func, {"model": model, "loader": eval_loader, "rank": rank,
                                             "world_size": world, "device": device}, "eval_func")
        results, final_loss = _results(train_out, eval_out)
        state = full_state_dict(model, parallelism, rank)
        weights = _upload_weights(reporter, state) if rank == 0 else None
        dist.barrier()
        reporter.status("completed", results=results, final_loss=final_loss, fingerprint=fingerprint(state),
                        weights_artifact=weights)
    except BaseException as exc:  # report every failure, then exit non-zero
        code = 1
        tb = traceback.format_exc()
        sys.__stderr__.write(tb)
        if isinstance(exc, ImportError) and not isinstance(exc, MissingPackage):
            exc = _missing_package(exc, where)  # the job's code imported it as it ran
        try:
            reporter.status("failed", error=f"{type(exc).__name__}: {exc}", traceback=tb,
                            collective=joined and _is_collective_error(exc))
        except Exception:
            log.exception("could not report the failure")
    finally:
        if system is not None:
            system.finish(sample=False)
        sys.stdout = sys.__stdout__
        reporter.close()
        if joined:
            try:
                import torch.distributed as dist
                dist.destroy_process_group()
            except Exception:
                pass
    return code


def _warm_up(device, parts: set[str]) -> None:
    """Pay while the slot is idle what a job's first seconds would otherwise pay. ``imports``:
    the modules DDP imports when it first wraps a model (torch._dynamo, about a second).
    Off by default, as they cost steady-state throughput on 2 x H200 (bench/README.md): ``kernels``
    (GPUs), the cuBLAS and cuDNN handles by a tiny bf16 forward and backward, 2.6%; ``nccl``,
    NCCL's one-time set-up by a DDP step in a process group of this process alone, measured
    only with ``kernels``: 2.8% together. Why a handle made early costs later is not known."""
    import torch
    import torch.distributed as dist
    cuda = device.type == "cuda"
    try:
        if "imports" in parts:
            import torch._dynamo  # noqa: F401
        if "kernels" in parts and cuda:
            model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.Flatten(), torch.nn.Linear(8 * 14 * 14, 8))
            with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
                model.to(device)(torch.randn(2, 3, 16, 16, device=device)).float().sum().backward()
            torch.cuda.synchronize(device)
        if "nccl" in parts:
            dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                    **({"device_id": device} if cuda else {}))
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8).to(device),
                                                              device_ids=[device.index] if cuda else None)
            model(torch.randn(2, 8, device=device)).sum().backward()
    except Exception:  # a warm-up that fails only costs the job its first seconds
        log.warning("standby warm-up on %s failed", device, exc_info=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def standby(device: str) -> int:
    """A rank process started ahead of its job: torch imported, (on a GPU) its CUDA context
    made and first-use costs paid (``_warm_up``; ZWDX_STANDBY_WARMUP lists which, "none" skips
    them) while the slot is idle. It waits for one line on stdin, ``{"env": {...}, "log": path}``,
    and then runs that rank as ``main`` does. Saves seconds of every job's start."""
    _die_with_parent()
    import torch
    import torch.distributed  # noqa: F401
    import torch.nn.parallel  # noqa: F401
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    from . import checkpoint, parallel  # noqa: F401
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        torch.empty(1, device=device)
    _warm_up(torch.device(device), set(os.environ.get("ZWDX_STANDBY_WARMUP", "imports").split(",")))
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # the GPU client let this standby go
    order = json.loads(line)
    os.environ.update(order["env"])
    log_fd = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    return main()


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--standby":
        sys.exit(standby(sys.argv[2]))
    sys.exit(main())
