"""The rules about a submitted model and functions that both sides apply: the SDK when it checks
a job (``zwdx.checks``) and the ranks when they train it (``gpu_client.rank``), so the two cannot
drift. A model's units (``repeated_blocks``: FSDP's default units and what a pipeline is cut
between; ``pipeline_units``), and how a rank calls the submitter's functions (``call_with``,
with the arguments zwdx offers each: ``OFFERED``, from ``zwdx.protocol``)."""
from __future__ import annotations

import inspect

from .protocol import EVAL_ARGS, LOADER_ARGS, TRAIN_ARGS

#: The named arguments offered to each of the submitter's functions: checked at submit, passed by the runner.
OFFERED = {"data_loader_func": LOADER_ARGS, "train_func": TRAIN_ARGS, "eval_func": EVAL_ARGS}


def has_forward(module) -> bool:
    """Whether ``module`` has a forward of its own (a ModuleList or ModuleDict has none)."""
    import torch
    return type(module).forward is not torch.nn.Module.forward


def repeated_blocks(module, path: str = "") -> list:
    """The modules of the outermost ModuleLists/Sequentials of two or more same-class modules,
    as ``[(name, module)]``: FSDP's units by default, and what a pipeline is cut between."""
    import torch
    kids = list(module.named_children())
    if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(kids) > 1 \
            and len({type(kid) for _, kid in kids}) == 1 and has_forward(kids[0][1]):
        return [(f"{path}{name}", kid) for name, kid in kids]
    found = []
    for name, kid in kids:
        found.extend(repeated_blocks(kid, f"{path}{name}."))
    return found


def sequential_children(module, path: str = "") -> list:
    """The children of the outermost ``nn.Sequential`` of two or more modules, as ``[(name, module)]``:
    what a pipeline cuts a model without repeated blocks between (a Sequential calls each child in
    turn, so a stage may begin at any of them)."""
    import torch
    if isinstance(module, torch.nn.Sequential) and len(module) > 1:
        return [(f"{path}{name}", kid) for name, kid in module.named_children()]
    for name, kid in module.named_children():
        found = sequential_children(kid, f"{path}{name}.")
        if found:
            return found
    return []


def pipeline_units(model) -> tuple[list, str]:
    """What a pipeline's ranges count and the default plan cuts between: the repeated blocks
    (``"blocks"``, cut by count), else the children of the outermost ``nn.Sequential``
    (``"children"``, cut by parameters: mixed layers differ in size); ``([], "blocks")`` if neither."""
    blocks = repeated_blocks(model)
    if blocks:
        return blocks, "blocks"
    children = sequential_children(model)
    return (children, "children") if children else ([], "blocks")


def call_with(fn, available: dict, what: str):
    """Call ``fn`` with the named arguments it declares, taken from ``available`` (the runner's
    values of ``OFFERED[what]``; it may leave out one the function has a default for)."""
    unknown = set(available) - set(OFFERED[what])
    if unknown:
        raise TypeError(f"zwdx offers {what} arguments that zwdx.protocol does not name: {sorted(unknown)}")
    sig = inspect.signature(fn)
    params = sig.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn(**available)
    kwargs = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in available:
            kwargs[p.name] = available[p.name]
        elif p.default is p.empty:
            raise TypeError(f"{what} declares argument '{p.name}', which zwdx does not provide; "
                            f"it provides {', '.join(sorted(available))}")
    return fn(**kwargs)
