"""PIPELINE on a GPU client: this rank runs one stage of the model, the ranks in stage order, with
``torch.distributed.pipelining`` (its tracer frontend and its schedules, as the PyTorch docs show);
with interleaved 1F1B several (rank r: stages r, r + ranks, ...), held as one ``Stages`` module.

Every rank traces the whole model (on the CPU, with one micro-batch of the first batch as the
example input) and cuts it where the plan says: each stage after the first begins at a module
(``torch.distributed.pipelining.SplitPoint.BEGINNING``), in training mode (a graph keeps the modes
it was traced in: a model submitted in eval mode, as ``from_pretrained`` returns one, would train
without dropout); a tied Parameter's copies sum their gradients (``stage_ties``). The plan
(``zwdx.protocol.pipeline``) gives block ranges or module names; left out, the model's repeated
blocks (the units FSDP shards, ``parallel.fsdp_plan``; a model without them: its nn.Sequential's
children, balanced by parameters, ``sized_ranges``) are cut by each rank's measured speed (a short
matmul timing) as far as its free GPU memory holds its blocks (``speed_shares``; the ranks
all-gather both first), or into equal runs on CPU slots (those of one host share its RAM and cores);
each cut at the block boundary nearest to its share. The rank keeps only its stage's module, on its
device; the stage's parameters keep the model's names (``transformer.h.3.mlp.weight``), so the
rebuilt optimizer's param groups, the checkpoints and the returned weights use the names the user
knows.

Why ``train_func`` cannot run its plain loop: ``model(x)`` on a stage would take the previous
stage's activations, not ``x``, and ``loss.backward()`` needs the gradient the next stage sends.
So a PIPELINE job's ``train_func`` declares ``pipeline`` and calls ``pipeline.step(x, y, loss_fn)``
where it would run forward and backward: the schedule (GPipe or 1F1B) splits the batch into
micro-batches, runs them through the stages, and accumulates every micro-batch's gradient (its loss
scaled by 1/micro-batches: the gradient of the batch's mean loss), onto what earlier steps left
(a loop that steps its optimizer every few batches). ``step`` returns that mean loss,
computed by the last stage and sent to every stage (one small broadcast), so the rest of the
loop (``optimizer.step()``, ``zero_grad()``, ``reporter.log_metrics(loss=...)``) stays as it was.

After training, rank 0 gathers every stage's weights (plain tensor sends, each of a shape rank 0
traced itself: nothing is unpickled), loads them into the whole model and runs ``eval_func`` on
it, on the CPU; the whole weights are what it uploads.

The strategy's surface, as ``parallel.Collective``'s; the data: a pipeline is one replica of the
model, so ``data_loader_func`` gets rank 0 of a world of 1 on every stage; but only the first
stage reads its training loader: its inputs go in, its targets go to the last stage each step
(``step``), and the other stages' loops run as many steps as it draws batches
(``FirstStageLoader``). Loaders need not agree: a ``shuffle=True`` one draws its own order in
each process, and a pass may be of random length.
"""
from __future__ import annotations

import inspect
import logging

import torch
import torch.distributed as dist
from torch import nn

from zwdx.protocol.pipeline import PipelineSettings
from zwdx.protocol.vocab import PipelineSchedule

from zwdx.model_rules import pipeline_units

from .layout import device_of, held_modules, line, local_params
from .parallel import Collective
from .stage_plan import BLOCK_FOOTPRINT, sized_ranges, weighted_ranges  # noqa: F401 (where callers found them)
from .stage_plan import matmul_speed, speed_shares, split_points
from .stage_ties import Ties, tied_names
from .stage_ties import optimizer_spec as tied_optimizer

log = logging.getLogger(__name__)


class Pipeline(Collective):
    """One stage of a PIPELINE job (see the module's docstring); ``step`` is what train_func gets."""

    part = True  # the rank's model is its stage

    def __init__(self, spec):
        super().__init__(spec)
        self.settings = spec.pipeline or PipelineSettings()
        #: The ranks, the stages each runs, all the stages; this rank, and its stages (r, r + ranks, ...).
        self.ranks, self.per = spec.world_size, self.settings.stages_per_rank or 1
        self.stages, self.index = self.ranks * self.per, spec.rank
        self.mine = [self.index + k * self.ranks for k in range(self.per)]
        self.microbatches = self.settings.microbatches or self.ranks
        self.whole: nn.Module | None = None     # rank 0: the whole model, the returned weights loaded
        self.tensors: list[list[tuple[str, torch.Size, torch.dtype]]] = []  # each stage's tensors
        self.held: list[str] = []  # the modules this rank's stage holds (``layout``)
        self.schedule = None
        self.ties: Ties | None = None  # the tied parameters' copies on this rank's stages
        self._loss_fn = None
        self._scale = False  # each micro-batch's loss divided by their number (not the gradients after)
        self._state: dict | None = None
        self._gathered = False

    # -- the strategy's surface ----------------------------------------------------------------
    def loader_arguments(self) -> dict:
        return {"rank": 0, "world_size": 1}

    def train_arguments(self) -> dict:
        return {"pipeline": self}

    def train_loader(self, loader):
        return FirstStageLoader(loader, self.index == 0, self._comm_device()) if self.ranks > 1 else loader

    def wrap(self, model: nn.Module, device, bundle: dict, report, example=None) -> nn.Module:
        """Trace ``model`` (on the CPU) with one micro-batch of ``example()``'s batch, cut it, and keep this
        rank's stage on ``device``; it is what the optimizer, the checkpoints and train_func see."""
        self.device = device
        shares = self._shares(model, device)  # a rank's share shared by its stages
        points, line = split_points(model, self.settings.stage_plan, self.stages,
                                    shares and [shares[i % self.ranks] for i in range(self.stages)])
        x = _inputs(example()).cpu()  # traced where the model is (a loader may put batches on the GPU)
        if x.shape[0] < self.microbatches:
            raise ValueError(f"a batch of {x.shape[0]} cannot be split into {self.microbatches} micro-batches "
                             f"(pipeline.microbatches)")
        ties = tied_names(model)
        pipe = self._traced(model, x, points)
        self.tensors = [sorted((k, v.shape, v.dtype) for k, v in pipe.get_stage_module(i).state_dict().items())
                        for i in range(self.stages)]
        self.held = held_modules(model, [name for name, _, _ in self._tensors_of(self.index)])
        stages = [pipe.build_stage(i, device) for i in self.mine]
        self.ties = Ties(ties, [stage.submod for stage in stages],
                         [{name for name, _, _ in self._tensors_of(r)} for r in range(self.ranks)])
        bundle["optimizer"] = tied_optimizer(bundle.get("optimizer"), ties)  # a stage may hold a tie by another name
        for stage in stages:
            if stage.is_last and hasattr(stage, "_validate_fwd_outputs"):
                # torch < 2.12 checks every stage's output against the (fp32, CPU) trace's dtypes at
                # every step. Under autocast the last stage's logits are bf16: a mismatch that matters
                # nowhere, for they go only to loss_fn, never to a peer (the activations between
                # stages, which fill the receivers' buffers, stay checked).
                stage._validate_fwd_outputs = lambda outputs: None
        self.schedule = self._scheduled(stages)
        self.whole = model if self.index == 0 else None
        if self.index == 0:
            each = f" ({self.per} stages a rank, rank r runs r, r + {self.ranks}, ...)" if self.per > 1 else ""
            line = (f"{line}; {self.microbatches} micro-batches of {x.shape[0] // self.microbatches}, "
                    f"schedule {self.settings.schedule.value}{each}")
            log.info("%s", line)
            report(line)
        return stages[0].submod if self.per == 1 else Stages([stage.submod for stage in stages])

    def _traced(self, model: nn.Module, x: torch.Tensor, points: list[str]):
        """The model traced with one micro-batch and cut at ``points`` (in train mode, its modes
        then put back): one stage per split, or ``ValueError`` saying which point is never called."""
        from torch.distributed.pipelining import SplitPoint
        from torch.distributed.pipelining import pipeline as trace
        modes = {m: m.training for m in model.modules()}
        model.train()  # a stage's modes are fixed by its trace: train_func's model.train() reaches no graph
        try:
            pipe = trace(model, mb_args=(x.tensor_split(self.microbatches)[0],),
                         split_spec={name: SplitPoint.BEGINNING for name in points})
        finally:
            for m, training in modes.items():
                m.training = training
        if pipe.num_stages != self.stages:
            raise ValueError(f"the model traced into {pipe.num_stages} stage(s), not {self.stages}: a split point "
                             f"({', '.join(points)}) is not called in the model's forward")
        return pipe

    def _scheduled(self, stages: list):
        """The schedule the settings name, over this rank's stages."""
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
        interleaved = self.settings.schedule == PipelineSchedule.INTERLEAVED_ONE_F_ONE_B
        cls = ScheduleInterleaved1F1B if interleaved else \
            Schedule1F1B if self.settings.schedule == PipelineSchedule.ONE_F_ONE_B else ScheduleGPipe
        # The schedule's own scaling divides every gradient after the step, those accumulated over
        # earlier steps too (a loop that steps its optimizer every few batches): each micro-batch's
        # loss is divided instead, where this torch lets the schedule leave the gradients alone.
        self._scale = "scale_grads" in inspect.signature(cls.__init__).parameters
        return cls(stages if interleaved else stages[0], n_microbatches=self.microbatches,
                   loss_fn=self._loss, **({"scale_grads": False} if self._scale else {}))

    def _tensors_of(self, rank: int) -> list[tuple[str, torch.Size, torch.dtype]]:
        """The tensors of every stage ``rank`` runs, stage by stage."""
        return [t for k in range(self.per) for t in self.tensors[rank + k * self.ranks]]

    def _shares(self, model: nn.Module, device) -> list[float] | None:
        """Each rank's share of the blocks for the automatic cut, in rank order, from every rank's
        free device memory and measured speed (one small all-gather; ``speed_shares``), when every
        rank is on a GPU; None when one is on a CPU slot (those of a host share its RAM and cores:
        an even cut). A plan the submitter gave: None, nothing measured."""
        if self.settings.stage_plan is not None:
            return None
        on_gpu, speed = device.type == "cuda", 0.0
        if on_gpu:
            try:
                speed = matmul_speed(device)
            except Exception as exc:  # unmeasured: the cut goes by free memory alone
                log.warning("PIPELINE: could not measure %s's speed: %s", device, exc)
        mine = [float(torch.cuda.mem_get_info(device)[0]) if on_gpu else 0.0, speed]
        comm = self._comm_device()
        every = [torch.zeros(2, dtype=torch.float64, device=comm) for _ in range(self.ranks)]
        dist.all_gather(every, torch.tensor(mine, dtype=torch.float64, device=comm))
        free, speed = zip(*([float(v) for v in t.tolist()] for t in every))
        if not all(free):
            return None
        units, _ = pipeline_units(model)
        if not all(speed) or not units:
            return list(free)
        unit_bytes = sum(p.numel() * p.element_size() for _, u in units for p in u.parameters()) / len(units)
        return speed_shares(len(units) * self.per, list(free), list(speed), unit_bytes)

    def layout(self, model: nn.Module) -> dict:
        """This rank's stage: its place in the order and the modules it holds."""
        params = local_params(model)
        place = {"index": self.mine[0], "of": self.stages, **({"virtual": self.mine} if self.per > 1 else {})}
        which = f"stage {self.index}" if self.per == 1 else f"stages {', '.join(map(str, self.mine))}"
        return {"role": "stage", "stage": place, "modules": self.held,
                "params": params, "device": device_of(model),
                "text": line(f"{which} of {self.stages}: {', '.join(self.held)}")}

    def sync_buffers(self, model: nn.Module) -> None:
        """Nothing: each stage's buffers are its own."""

    def evaluated(self, model: nn.Module, device=None) -> tuple[nn.Module, torch.device] | None:
        """Rank 0: the whole model with every stage's trained weights, on the CPU; the others: None."""
        state = self.full_state(model)
        if state is None:
            return None
        self.whole.to("cpu").load_state_dict(state)  # its first stage's parameters went to the device
        return self.whole, torch.device("cpu")

    def full_state(self, model: nn.Module) -> dict | None:
        """Rank 0: the whole model's weights, gathered once; the others: None. Collective."""
        if not self._gathered:
            self._state, self._gathered = self._gather(model), True
        return self._state

    # -- what train_func calls -----------------------------------------------------------------
    def step(self, x=None, y=None, loss_fn=None) -> torch.Tensor:
        """One batch forward and backward through every stage: the first stage's ``x`` and ``y``
        (its loader's batch: ``x`` goes in, ``y`` is sent to the last stage), the last stage's
        ``loss_fn(output, y)``; every rank may pass all three. The other stages' ``x`` and ``y``
        are not used (``FirstStageLoader`` gives them a stand-in batch). Gradients accumulate
        into this stage's parameters; returns the batch's mean loss over its micro-batches (a 0-d
        tensor, on every stage)."""
        first, last = self.index == 0, self.index == self.ranks - 1  # stage 0's rank, the last stage's
        if first and (x is None or y is None):
            raise ValueError("pipeline.step(x, y, loss_fn): the first stage needs its batch's inputs x and targets "
                             "y (the targets go to the last stage with the micro-batches)")
        if last and loss_fn is None:
            raise ValueError("pipeline.step(x, y, loss_fn): the last stage needs the loss_fn")
        if self.ranks > 1 and first:
            self._send_targets(y)
        elif self.ranks > 1 and last:
            y = self._receive_targets()
        self._loss_fn = loss_fn
        losses: list[torch.Tensor] = []
        args = (x.to(self.device),) if first else ()
        kwargs = {"target": y.to(self.device), "losses": losses} if last else {}
        self.ties.before_step()
        self.schedule.step(*args, **kwargs)
        comm = self._comm_device()
        self.ties.sum_grads(comm)
        loss = torch.stack([v.detach().float() for v in losses]).mean().to(comm) * self._undo if last \
            else torch.zeros((), dtype=torch.float32, device=comm)
        if self.ranks > 1:
            dist.broadcast(loss, src=self.ranks - 1)
        return loss

    def _loss(self, output, target):
        loss = self._loss_fn(output, target)
        return loss / self.microbatches if self._scale else loss

    @property
    def _undo(self) -> int:
        """What the last stage's losses are multiplied by to say the batch's mean loss."""
        return self.microbatches if self._scale else 1

    def _send_targets(self, y) -> None:
        """The first stage's targets to the last stage: a header (dtype, shape), then the tensor."""
        if not isinstance(y, torch.Tensor) or y.dtype not in TARGET_DTYPES or y.dim() > MAX_TARGET_DIMS:
            what = f"a {y.dtype} tensor of {y.dim()} dimensions" if isinstance(y, torch.Tensor) else type(y).__name__
            raise TypeError(f"pipeline.step: the targets y must be a tensor of at most {MAX_TARGET_DIMS} dimensions "
                            f"of a number or bool dtype, got {what}")
        comm, shape = self._comm_device(), list(y.shape) + [0] * (MAX_TARGET_DIMS - y.dim())
        dist.send(torch.tensor([TARGET_DTYPES.index(y.dtype), y.dim(), *shape], dtype=torch.int64, device=comm),
                  dst=self.ranks - 1)
        dist.send(y.detach().to(comm, torch.uint8 if y.dtype == torch.bool else y.dtype).contiguous(),
                  dst=self.ranks - 1)

    def _receive_targets(self) -> torch.Tensor:
        """The last stage: the first stage's targets for this step (``_send_targets``)."""
        comm = self._comm_device()
        head = torch.empty(2 + MAX_TARGET_DIMS, dtype=torch.int64, device=comm)
        dist.recv(head, src=0)
        code, dims, *shape = head.tolist()
        dtype = TARGET_DTYPES[code]
        y = torch.empty(shape[:dims], dtype=torch.uint8 if dtype == torch.bool else dtype, device=comm)
        dist.recv(y, src=0)
        return y.to(dtype=dtype)

    # -- the weights -----------------------------------------------------------------------------
    def _comm_device(self):
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _gather(self, model: nn.Module) -> dict | None:
        """Every stage's state to rank 0, each tensor sent whole, in name order: rank 0 allocates
        what it traced, so only raw bytes cross (no pickle). Collective: every rank calls it."""
        comm = self._comm_device()
        mine = model.state_dict()
        if self.index != 0:
            for name, _, _ in self._tensors_of(self.index):
                dist.send(mine[name].detach().to(comm).contiguous(), dst=0)
            return None
        state = {k: v.detach().cpu() for k, v in mine.items()}
        for rank in range(1, self.ranks):
            for name, shape, dtype in self._tensors_of(rank):
                buf = torch.empty(shape, dtype=dtype, device=comm)
                dist.recv(buf, src=rank)
                state[name] = buf.cpu()
        return state


#: The dtypes a batch's targets may have (they cross from the first stage to the last as raw bytes),
#: and the most dimensions.
TARGET_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                 torch.float32, torch.float64, torch.float16, torch.bfloat16)
MAX_TARGET_DIMS = 8


class FirstStageLoader:
    """A stage's training loader: only the first stage reads the user's loader, and tells the
    others batch by batch whether another comes (one small broadcast); they yield their own
    loader's first batch as many times (its shape, for the loop's code: the schedule takes their
    inputs from the previous stage and the targets from the first). So every stage's loop runs
    the first stage's steps, whatever its loader (shuffled, of random length), and the others
    load no data to throw away. Everything else (``len``, ``sampler.set_epoch``) is the user's loader."""

    def __init__(self, loader, first: bool, comm):
        self._loader, self._first, self._comm = loader, first, comm
        self._example = None

    def __iter__(self):
        if self._first:
            for batch in self._loader:
                self._another(True)
                yield batch
            self._another(False)
            return
        if self._example is None:
            with torch.random.fork_rng(devices=[]):  # the generators as the user's code left them
                self._example = next(iter(self._loader))
        while self._another():
            yield self._example

    def _another(self, more: bool | None = None) -> bool:
        flag = torch.tensor([int(bool(more))], dtype=torch.int64, device=self._comm)
        dist.broadcast(flag, src=0)
        return bool(flag.item())

    def __len__(self):
        return len(self._loader)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class Stages(nn.Module):
    """The stages one rank runs (interleaved) as one module for the optimizer, the checkpoints and
    the weights: their parameters and buffers under the model's own names (the stages share none);
    ``train()``/``eval()`` reach every stage. Its forward is the schedule's, never called."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self._parts = list(parts)  # a plain list: registered, their names would be prefixed
        for part in parts:
            persistent = set(part.state_dict())
            for name, param in part.named_parameters():
                self._holder(name).register_parameter(name.rsplit(".", 1)[-1], param)
            for name, buf in part.named_buffers():
                self._holder(name).register_buffer(name.rsplit(".", 1)[-1], buf, persistent=name in persistent)

    def _holder(self, name: str) -> nn.Module:
        node = self
        for part in name.split(".")[:-1]:
            if part not in node._modules:
                node.add_module(part, nn.Module())
            node = node._modules[part]
        return node

    def train(self, mode: bool = True):
        super().train(mode)
        for part in self._parts:
            part.train(mode)
        return self


def _inputs(batch):
    """The model's input in a batch from the loader: the batch, or its first item."""
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"PIPELINE: the loader's batches must be tensors or (input, target) pairs of tensors, "
                        f"got {type(x).__name__}")
    return x
