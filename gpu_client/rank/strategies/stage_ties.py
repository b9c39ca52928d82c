"""A PIPELINE job's tied parameters (a head tied to the token embedding, as nanoGPT and Hugging
Face models tie them): one Parameter under several names in the whole model, which the tracer
copies into every stage that uses one of them (``torch.distributed.pipelining`` keeps no tie).
As Megatron-LM does for its word embeddings, each rank makes its stages' copies one Parameter
again, and after every ``pipeline.step`` the ranks that hold a copy sum their gradients (a
group of their own): each copy then takes the gradient one process's single Parameter would,
and every copy, stepped alike from the same value, stays equal. The submitter's optimizer names
the Parameter once (its first name): each of its names goes into that param group, so every
stage's copy is optimized (``optimizer_spec``).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each Parameter that has several, the first as ``named_parameters`` says it."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def optimizer_spec(spec: dict | None, ties: list[list[str]]) -> dict | None:
    """The submitter's optimizer (``zwdx.bundle.optimizer_spec``) with every name of a tied
    Parameter where its first name is: a stage may hold it under another."""
    if spec is None or not ties:
        return spec
    alias = {group[0]: group for group in ties}
    groups = [{**g, "params": None if g["params"] is None else [a for n in g["params"] for a in alias.get(n, [n])]}
              for g in spec["groups"]]
    return {**spec, "groups": groups}


class Ties:
    """This rank's copies of the tied Parameters (one a group of names, its stages' copies made
    one) and, for those other ranks hold too, the process group that sums their gradients."""

    def __init__(self, ties: list[list[str]], parts: list[nn.Module], held_by: list[set[str]]):
        """``parts``: this rank's stage modules; ``held_by[r]``: the tensor names rank r holds.
        Collective: every rank makes every group (``dist.new_group``) in the same order."""
        self.shared: list[tuple[nn.Parameter, object]] = []
        self._before: list[torch.Tensor | None] | None = None
        for names in ties:
            holders = [r for r, held in enumerate(held_by) if held & set(names)]
            group = dist.new_group(holders) if len(holders) > 1 else None
            param = _unite(parts, names)
            if param is not None and group is not None:
                self.shared.append((param, group))

    def before_step(self) -> None:
        """Keep the shared copies' gradients as they are before a step (summed already, where
        the loop accumulates over several steps): only the step's own part is summed after."""
        self._before = [None if p.grad is None else p.grad.detach().clone() for p, _ in self.shared]

    def sum_grads(self, comm: torch.device) -> None:
        """Each shared copy's gradient := the sum over the ranks that hold one of what the step
        added (a rank whose stage did not use its copy adds zeros), on top of what it had."""
        for (param, group), before in zip(self.shared, self._before or [None] * len(self.shared)):
            grad = param.grad if param.grad is not None else torch.zeros_like(param)
            added = (grad if before is None else grad - before).detach().to(comm)
            dist.all_reduce(added, group=group)
            added = added.to(param.device)
            param.grad = added if before is None else before + added
        self._before = None


def _unite(parts: list[nn.Module], names: list[str]) -> nn.Parameter | None:
    """The stages' copies of one tied Parameter made the first of them; None where none is here."""
    first = None
    for part in parts:
        for name in names:
            owner, _, leaf = name.rpartition(".")
            try:
                module = part.get_submodule(owner) if owner else part
            except AttributeError:
                continue
            if not isinstance(module._parameters.get(leaf), nn.Parameter):
                continue
            if first is None:
                first = module._parameters[leaf]
            else:
                module._parameters[leaf] = first
    return first
