"""Mixed devices in one DDP job (``submit_job(..., devices="mixed")``): GPU and CPU ranks
together over gloo, each rank's batch weighted by its measured speed, so that a fast rank does
not wait for a slow one at every gradient all-reduce.

Before the job's loaders are made, every rank times forward and backward of a copy of the
user's model on a sample batch of its own device (``measure``: a warm-up step, then at least
``PROBE_STEPS`` steps and ``PROBE_SECONDS``; the output's sum stands in for the loss), and the
ranks all-gather the figures. The job's global batch (``global_batch``, or the world size times
the default of ``data_loader_func``'s ``batch_size``) is then shared out in proportion to them
(``shares``: a sample at least each, the rest by the largest remainders), the same on every
rank. ``data_loader_func`` is called with this rank's ``batch_size`` and a ``sampler``:
``sampler(dataset, shuffle=True, seed=0)`` gives a ``ShareSampler``, which cuts one order of
the dataset (drawn alike on every rank, reshuffled per epoch by ``set_epoch``) into global
batches and each global batch into the ranks' shares, in rank order: every rank takes the same
number of steps, and the ranks' batches of one step are together one global batch. The ranks
check that their loaders take the same number of steps per pass before training.

Each rank's gradient is its batch's mean (a loss that is a mean over the batch). DDP's
all-reduce sums them after a comm hook scaled each by its rank's share of the global batch
(``b_i / G``, instead of DDP's ``1 / world_size``), so the sum is the mean over every sample of
the global batch: the update one process would make over the concatenated batch. A model whose
layers depend on the batch (BatchNorm) sees each rank's own batch there, as under plain DDP.

gloo moves CUDA tensors through pinned host memory (its CUDA broadcast and all-reduce work
copy to the host, reduce there, and copy back), which is the price of a mixed job; a mixed job
placed on GPUs only keeps NCCL (the server picks the backend from the placement). After
training every rank takes rank 0's parameters and buffers, so that replicas whose optimizer
steps ran on different devices (and rounded differently) evaluate and return the same model.

Rank 0 writes the measured speeds and the shares to the job's log; every rank records its
``batch_size`` and ``measured_speed`` (samples/s) as metrics, and ``layout`` says them for the
job's plan. FSDP, PIPELINE and DILOCO are refused at submit (``zwdx.protocol.rest.SubmitJob``).
"""
from __future__ import annotations

import copy
import inspect
import logging
import math
import time

import torch
import torch.distributed as dist
from torch import nn

from gpu_client.rank.failures import watch_gradients
from gpu_client.rank.metrics import batch_size
from .parallel import Collective

log = logging.getLogger(__name__)

#: The probe's least number of timed steps, and least seconds, after one warm-up step.
PROBE_STEPS = 3
PROBE_SECONDS = 0.5


class Mixed(Collective):
    """A DDP replica whose batch is its share of the global batch, by measured speed."""

    def __init__(self, spec, reporter=None):
        super().__init__(spec)
        self.reporter = reporter
        self.global_batch: int | None = None
        self.speeds: list[float] = []   # every rank's samples/s, in rank order (0.0: not measured)
        self.batches: list[int] = []    # every rank's batch, in rank order
        self.device: torch.device | None = None

    @property
    def batch(self) -> int:
        return self.batches[self.spec.rank]

    @property
    def weight(self) -> float:
        """This rank's share of the gradient: its share of the global batch."""
        return self.batch / self.global_batch

    # -- the loaders -----------------------------------------------------------------------------
    def loaders(self, make, bundle: dict, device: torch.device):
        """Measure, share the global batch out, and make this rank's loaders with its share."""
        spec, self.device = self.spec, device
        world = spec.world_size
        self.global_batch = global_batch(spec.global_batch, bundle["data_loader_func"], world)
        even = shares(self.global_batch, [1.0] * world)
        first = make(self._arguments(even))
        speed = 0.0
        try:
            speed = measure(bundle["model"], device, sample(first[0], device))
        except Exception as exc:  # a model the probe cannot call: every rank gets an even share
            log.warning("mixed devices: could not time the model on a sample batch (%s: %s)", type(exc).__name__, exc)
            if self.reporter is not None:
                self.reporter.log(f"mixed devices: could not time the model on rank {spec.rank} "
                                  f"({type(exc).__name__}: {exc}); the batches are shared out evenly")
        self.speeds = gather_floats(speed, device)
        self.batches = shares(self.global_batch, self.speeds)
        made = first if self.batches == even else make(self._arguments(self.batches))
        same_steps(made[0], spec.rank, device)
        self._tell()
        return made

    def _arguments(self, batches: list[int]) -> dict:
        starts = [sum(batches[:r]) for r in range(len(batches))]
        rank, total = self.spec.rank, self.global_batch
        return {**self.loader_arguments(), "batch_size": batches[rank],
                "sampler": Sampling(starts[rank], batches[rank], total)}

    def _tell(self) -> None:
        if self.reporter is None:
            return
        self.reporter.log_system(batch_size=self.batch, measured_speed=self.speeds[self.spec.rank])
        if self.spec.rank == 0:
            line = describe(self.speeds, self.batches, self.global_batch)
            log.info("%s", line)
            self.reporter.log(line)

    def replicas(self) -> float:
        """This rank's samples times this make the job's (rank 0 counts them): the global batch over its share."""
        return self.global_batch / self.batch

    # -- the model -------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, device: torch.device, bundle: dict, report, example=None) -> nn.Module:
        """DDP, whose all-reduce sums the ranks' gradients each scaled by its share (``weight``)."""
        from torch.nn.parallel import DistributedDataParallel
        ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model.to(device), device_ids=ids)
        watch_gradients(model, weight=self.weight)
        return model

    def sync_buffers(self, model: nn.Module) -> None:
        """Rank 0's parameters and buffers on every rank: replicas on different devices round differently."""
        super().sync_buffers(model)
        if dist.get_world_size() == 1:
            return
        with torch.no_grad():
            for param in model.parameters():
                dist.broadcast(param.data, src=0)

    def layout(self, model: nn.Module) -> dict:
        """What this rank holds, for the job's plan: a whole replica, its batch and gradient share."""
        inner = getattr(model, "module", model)
        speed = self.speeds[self.spec.rank] if self.speeds else 0.0
        return {"role": "replica", "device": str(self.device),
                "text": f"a replica on {self.device}: batch {self.batch} of {self.global_batch} "
                        f"({self.weight:.0%} of the gradient), measured {speed:.0f} samples/s",
                "modules": [name for name, _ in inner.named_children()][:64],
                "params": sum(p.numel() for p in inner.parameters()),
                "batch": self.batch, "weight": self.weight}


def describe(speeds: list[float], batches: list[int], total: int) -> str:
    """One line for the job's log: each rank's measured speed, and the shares."""
    measured = ", ".join(f"rank {r} {s:.0f}" for r, s in enumerate(speeds))
    how = "by measured speed" if all(s > 0 for s in speeds) else "evenly (a rank could not be timed)"
    return (f"mixed devices: samples/s measured {measured}; the global batch of {total} shared out {how}: "
            f"{' + '.join(str(b) for b in batches)}; each rank's gradient weighted by its share")


# -- the arithmetic ------------------------------------------------------------------------------
def global_batch(given: int | None, loader_func, world: int) -> int:
    """The job's global batch: as submitted, or the world size times the default of
    ``data_loader_func``'s ``batch_size``; at least a sample a rank."""
    if given is None:
        declared = inspect.signature(loader_func).parameters.get("batch_size")
        default = None if declared is None else declared.default
        if not isinstance(default, int) or isinstance(default, bool) or default < 1:
            raise ValueError("devices=\"mixed\": data_loader_func must declare batch_size (this rank's share of "
                             "the global batch), and global_batch must be given unless batch_size has a default")
        given = default * world
    if given < world:
        raise ValueError(f"devices=\"mixed\": the global batch ({given}) is smaller than the world size ({world}): "
                         f"every rank needs a sample at least")
    return given


def shares(total: int, speeds: list[float]) -> list[int]:
    """``total`` samples shared out in proportion to ``speeds``: a sample at least each, the
    rest by the largest remainders (ties to the lower rank). Even when a speed is not positive."""
    n = len(speeds)
    if total < n:
        raise ValueError(f"{total} samples cannot give {n} ranks one each")
    weights = speeds if all(s > 0 and math.isfinite(s) for s in speeds) else [1.0] * n
    rest, whole = total - n, sum(weights)
    exact = [rest * w / whole for w in weights]
    base = [int(e) for e in exact]
    for i in sorted(range(n), key=lambda i: (-(exact[i] - base[i]), i))[:rest - sum(base)]:
        base[i] += 1
    return [b + 1 for b in base]


class Sampling:
    """What ``data_loader_func`` gets as ``sampler``: ``sampler(dataset, shuffle=True, seed=0)``,
    a ``ShareSampler`` of this rank's share."""

    def __init__(self, start: int, size: int, total: int):
        self.start, self.size, self.total = start, size, total

    def __call__(self, dataset, shuffle: bool = True, seed: int = 0) -> ShareSampler:
        return ShareSampler(len(dataset), self.start, self.size, self.total, shuffle=shuffle, seed=seed)

    def __repr__(self) -> str:
        return f"sampler(dataset, shuffle=True, seed=0): samples {self.start}..{self.start + self.size - 1} of " \
               f"each global batch of {self.total}"


class ShareSampler(torch.utils.data.Sampler):
    """This rank's slice ``[start, start + size)`` of every global batch of ``total`` indices of
    one order of the dataset, the same on every rank (shuffled by ``seed`` and the epoch, as
    ``DistributedSampler``); the last global batch, if partial, is dropped. With a DataLoader of
    ``batch_size=size`` each batch is the rank's share of one global batch."""

    def __init__(self, length: int, start: int, size: int, total: int, shuffle: bool = True, seed: int = 0):
        if length < total:
            raise ValueError(f"devices=\"mixed\": the dataset has {length} samples, less than one global batch "
                             f"({total})")
        self.length, self.start, self.size, self.total = length, start, size, total
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.steps = length // total

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        else:
            order = list(range(self.length))
        for step in range(self.steps):
            at = step * self.total + self.start
            yield from order[at:at + self.size]

    def __len__(self) -> int:
        return self.steps * self.size


# -- measuring -----------------------------------------------------------------------------------
def sample(loader, device: torch.device):
    """The loader's first batch on ``device``, drawn without moving the generators training uses."""
    with torch.random.fork_rng(devices=[]):
        return _to(next(iter(loader)), device)


def measure(model: nn.Module, device: torch.device, batch, steps: int = PROBE_STEPS,
            seconds: float = PROBE_SECONDS) -> float:
    """Samples per second of forward and backward of a copy of ``model`` on ``device`` over
    ``batch`` (its output's sum as the loss): one warm-up step, then ``steps`` and ``seconds`` at least."""
    probe = copy.deepcopy(model).to(device).train()
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    n = batch_size(batch)

    def step(model):
        _first_tensor(_call(model, batch)).float().sum().backward()
    try:
        with torch.random.fork_rng(devices=cuda):  # dropout draws: the job's generators stay where they were
            step(probe)
            _synchronize(device)
            began, done = time.perf_counter(), 0
            while done < steps or time.perf_counter() - began < seconds:
                step(probe)
                done += 1
            _synchronize(device)
            took = time.perf_counter() - began
    finally:
        del probe
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return n * done / max(took, 1e-9)


def gather_floats(value: float, device: torch.device) -> list[float]:
    """Every rank's ``value``, in rank order (one all-gather; on the GPU under NCCL)."""
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    mine = torch.tensor([value], dtype=torch.float64, device=comm)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return [float(t.item()) for t in every]


def same_steps(loader, rank: int, device: torch.device) -> None:
    """Every rank's loader takes the same number of steps per pass, or every rank raises, naming them."""
    try:
        mine = len(loader)
    except TypeError:
        mine = -1  # an iterable dataset: not known
    counts = [int(c) for c in gather_floats(float(mine), device)]
    if -1 in counts or len(set(counts)) == 1:
        return
    raise ValueError("devices=\"mixed\": the ranks' loaders take different numbers of steps per pass ("
                     + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts)) + "); DDP needs the same on every "
                     "rank: build the DataLoader with batch_size=batch_size and sampler=sampler(dataset), the "
                     "two data_loader_func gets")


def _to(batch, device: torch.device):
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to(b, device) for b in batch) if not hasattr(batch, "_fields") else batch
    if isinstance(batch, dict):
        return {k: _to(v, device) for k, v in batch.items()}
    return batch


def _call(model: nn.Module, batch):
    """The model on a batch as loaders give them: a tensor, (input, target), or keyword inputs."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        return model(batch[0])
    return model(batch)


def _first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else []
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value
    raise TypeError(f"the model's output ({type(out).__name__}) holds no floating-point tensor to time a backward of")


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
