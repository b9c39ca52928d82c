"""TP and FSDP+TP on a GPU client: the model's Linear pairs split over a TP group of ranks, with
DTensor (``torch.distributed.tensor.parallel.parallelize_module``), as torchtitan's
``parallelize`` does for llama.

The ranks form a 2-D mesh ``("dp", "tp")`` in rank order: a TP group is ``tp_size`` consecutive
ranks, which the placement put on one GPU client (its GPUs, or its CPU slots); TP is one group
(dp 1). Each group splits the modules of the plan (``zwdx.tp_plan``: the submitter's
``tp_plan``, or one derived from the model) over its ranks: ``colwise`` splits a module's output
features (the weight's rows), ``rowwise`` its input features, the partial outputs summed
(all-reduce). FSDP+TP then shards every unit (``parallel.fsdp_plan``) and the root with FSDP2's
``fully_shard`` over the ``dp`` sub-mesh, across the groups: TP first, then FSDP, as torchtitan
composes them.

Why the results are those of one process, whatever the model's code does between a pair:

- A ``colwise`` module's output stays a DTensor (``use_local_output=False``): the code after it
  (``view`` into heads, ``transpose``, the attention itself, an activation) runs on DTensors,
  which keep the global shapes, so ``x.view(B, T, n_head, head_dim)`` is right with any head
  count, and an op whose sharding the DTensor cannot keep gathers what it needs first. (The PyTorch
  TP tutorial instead divides the model's head count by the TP size, for models whose code reads
  local shapes; no attribute of the model is changed here.)
- A plain tensor that meets a DTensor there (a causal-mask buffer, rotary frequencies) is the
  same on every rank of the group, so it is taken as replicated (DTensor's implicit replication,
  switched on for the rank's process).
- A ``rowwise`` module takes its input as it comes: a DTensor is redistributed to its input
  features' split; a plain tensor is the whole input (every rank of a group holds the same) and
  each rank takes its part. Its output is summed over the group and plain again.
- Whatever a module holding a split Linear returns is plain: a DTensor in its output (a colwise
  module whose output leaves the module) is gathered whole (``full_tensor``, differentiable).
- The group's ranks read the same batches (``data_loader_func`` gets the dp rank and size) and
  start with the same random generators (the group's first rank's), so the replicated modules
  (embeddings, norms, the head: left whole) compute the same on each, and their gradients
  (all-reduced through the DTensors' backward) are the same.

The weights come back whole (``get_model_state_dict(full_state_dict=True)``); checkpoints are
the ``shards`` format (``shards.py``: each rank's local shards of every DTensor, safetensors and
a JSON index), which reshards on resume.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from zwdx import tp_plan

from .parallel import Collective, describe_plan, fsdp_plan, full_state_dict

log = logging.getLogger(__name__)

#: How many module names ``layout`` lists at most.
LAYOUT_MODULES = 64


class TensorParallel(Collective):
    """A rank of a TP or FSDP+TP job (see the module's docstring)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.tp = spec.tp_size or spec.world_size
        if spec.world_size % self.tp:
            raise ValueError(f"tp_size {self.tp} does not divide the job's {spec.world_size} ranks")
        self.dp = spec.world_size // self.tp
        self.dp_rank, self.tp_rank = divmod(spec.rank, self.tp)
        self.fsdp = spec.parallelism.value == "FSDP+TP"
        self.plan: dict[str, str] = {}
        self.device = torch.device("cpu")

    # -- the strategy's surface ----------------------------------------------------------------
    def loader_arguments(self) -> dict:
        """A TP group is one replica: its ranks read the same batches, the dp rank's of dp size."""
        return {"rank": self.dp_rank, "world_size": self.dp}

    def wrap(self, model: nn.Module, device, bundle: dict, report, example=None) -> nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        self.device = device
        model = model.to(device)
        self.plan, line = self._plan(model, self.spec.tp_plan)
        mesh = init_device_mesh(device.type, (self.dp, self.tp), mesh_dim_names=("dp", "tp"))
        self._same_generators(mesh["tp"].get_group())
        split(model, mesh["tp"], self.plan)
        if self.fsdp:
            from torch.distributed.fsdp import fully_shard
            chosen, skipped = fsdp_plan(model, bundle.get("fsdp_units"))
            line += "; " + describe_plan(model, chosen, skipped)
            for _, module in sorted(chosen, key=lambda unit: -unit[0].count(".")):  # inner units first
                fully_shard(module, mesh=mesh["dp"])
            fully_shard(model, mesh=mesh["dp"])
        if self.spec.rank == 0:
            log.info("%s", line)
            report(line)
        return model

    def _plan(self, model: nn.Module, given) -> tuple[dict[str, str], str]:
        """The plan to apply (the submitter's, resolved, or derived) and a line for the job's log."""
        mode = self.spec.parallelism.value
        if given:
            plan, how = tp_plan.resolve(model, given), "tp_plan"
        else:
            plan, skipped = tp_plan.derive(model)
            plan, odd = tp_plan.whole_heads(model, plan, self.tp)
            skipped += odd
            if not plan:
                raise ValueError(tp_plan.no_pairs(model, mode, skipped))
            how = "derived" + ("; " + tp_plan.left_whole(skipped) if skipped else "")
        bad = tp_plan.split_sizes(model, plan, self.tp)
        if bad:
            raise ValueError(f"{mode}: a TP group of {self.tp} cannot split {', '.join(bad[:4])}: the split features "
                             f"must divide by {self.tp}")
        shape = f"dp {self.dp} x tp {self.tp}" if self.fsdp else f"one TP group of {self.tp}"
        return plan, f"{mode} ({shape}): {tp_plan.describe(plan)}, {how}"

    def _same_generators(self, group) -> None:
        """Every rank of the TP group takes its first rank's random generators (CPU and the
        rank's GPU): the replicated modules' dropout, say, draws the same on each."""
        if self.tp == 1:
            return
        first = dist.get_global_rank(group, 0)
        comm = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        states = [torch.get_rng_state()] + ([torch.cuda.get_rng_state(self.device)] if self.device.type == "cuda" else [])
        for i, state in enumerate(states):
            buf = state.to(comm)
            dist.broadcast(buf, src=first, group=group)
            if i == 0:
                torch.set_rng_state(buf.cpu())
            else:
                torch.cuda.set_rng_state(buf.cpu(), self.device)

    def full_state(self, model: nn.Module) -> dict | None:
        """The whole model's weights on CPU, the DTensors gathered (collective)."""
        return full_state_dict(model, "FSDP", self.spec.rank)

    def layout(self, model: nn.Module) -> dict:
        """What this rank holds (the plan-drawing interface): its part of each split module, the
        replicated rest whole, and its place in the mesh."""
        from torch.distributed.tensor import DTensor
        held = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        role = "fsdp+tp" if self.fsdp else "tp"
        where = f"TP group {self.dp_rank}, {self.tp_rank + 1} of {self.tp}"
        text = f"column/row 1/{self.tp} of {len(self.plan)} Linear layers ({where})"
        if self.fsdp:
            text += f"; FSDP shard {self.dp_rank + 1} of {self.dp} of every weight"
        return {"role": role, "text": text, "modules": list(self.plan)[:LAYOUT_MODULES], "params": int(held),
                "mesh": {"dp": self.dp_rank, "tp": self.tp_rank, "dp_size": self.dp, "tp_size": self.tp},
                "device": str(self.device)}


def split(model: nn.Module, mesh, plan: dict[str, str]) -> None:
    """Apply ``plan`` over the 1-D ``mesh``: colwise modules keep DTensor outputs, rowwise ones take
    any input; every module holding a split one returns plain tensors; plain tensors meeting
    DTensors count as replicated (see the module's docstring)."""
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    styles = {"colwise": lambda: ColwiseParallel(use_local_output=False),
              "rowwise": lambda: RowwiseParallel(input_layouts=Replicate())}
    parallelize_module(model, mesh, {name: styles[style]() for name, style in plan.items()})
    DTensor._op_dispatcher._allow_implicit_replication = True  # what experimental.implicit_replication() sets
    if mesh.device_type == "cpu":
        register_cpu_attention()
    modules = dict(model.named_modules())
    for parent in sorted({name.rpartition(".")[0] for name in plan}):
        modules[parent].register_forward_hook(_plain_outputs)
        _named_on_error(modules[parent], parent or type(model).__name__,
                        [n.rpartition(".")[2] for n in plan if n.rpartition(".")[0] == parent])


def _named_on_error(module: nn.Module, name: str, children: list[str]) -> None:
    """An error raised in ``module``'s forward says which module it was and what the plan split
    in it (a note on the same exception: its type, which tells a lost peer, stays)."""
    forward = module.forward

    def named(*args, **kwargs):
        try:
            return forward(*args, **kwargs)
        except Exception as exc:
            if not getattr(exc, "_zwdx_tp_named", False):
                exc._zwdx_tp_named = True
                exc.add_note(f"TP: raised in {name} ({type(module).__name__}), whose {', '.join(children)} the TP plan "
                             f"splits; its forward runs on DTensors there: leave it whole (tp_plan without it) or "
                             f"make its code fit the split")
            raise
    module.forward = named


def _plain_outputs(module, args, output):
    """A module's output with each DTensor gathered whole (differentiably)."""
    from torch.distributed.tensor import DTensor
    if isinstance(output, DTensor):
        return output.full_tensor()
    if isinstance(output, (tuple, list)) and any(isinstance(o, DTensor) for o in output):
        return type(output)(o.full_tensor() if isinstance(o, DTensor) else o for o in output)
    if isinstance(output, dict) and any(isinstance(o, DTensor) for o in output.values()):
        return {k: o.full_tensor() if isinstance(o, DTensor) else o for k, o in output.items()}
    return None


_registered = False


def register_cpu_attention() -> None:
    """DTensor has sharding rules for the CUDA kernels of ``F.scaled_dot_product_attention`` but
    none for its CPU kernel: these say what the CUDA ones do, split by batch or by head (every
    tensor of the op is ``[batch, heads, ...]``), else whole. Registered once, for CPU ranks."""
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding
    aten = torch.ops.aten

    def ways(tensors_in: int, tensors_out: int, others: int, mask) -> list:
        dims = [Replicate()] + ([Shard(0), Shard(1)] if mask is None else [])
        return [([p] * tensors_out, [p] * tensors_in + [None] * others + [None if mask is None else Replicate(), None])
                for p in dims]

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu.default)
    def _forward(query, key, value, dropout_p=0.0, is_causal=False, attn_mask=None, scale=None):
        return ways(3, 2, 2, attn_mask)

    @register_sharding(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None):
        return ways(6, 3, 2, attn_mask)

    _registered = True
