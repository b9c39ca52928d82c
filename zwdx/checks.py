"""What the SDK checks before it uploads a job, and how a rank calls the submitter's functions.

Each of the submitter's functions is called with the named arguments it declares, out of those
zwdx offers it (``OFFERED``, from ``zwdx.protocol``): ``check_signature`` refuses at submit a
function that declares one zwdx does not offer, and ``call_with`` is how the runner calls it, so
the two cannot drift (both in ``zwdx.model_rules``, with the model's units: the ranks use them too). ``unpicklable_error`` names the variable (and its type) that keeps a job
from being pickled, instead of cloudpickle's bare error; ``fsdp_units_spec`` checks FSDP's
``fsdp_units``, ``check_pipeline`` a pipeline's ``stage_plan``, ``check_tp_plan`` a TP job's
``tp_plan``, ``check_devices`` a mixed-devices job's ``data_loader_func``. Every refusal is a
``BadRequest`` naming the field.
"""
from __future__ import annotations

import inspect
import pickle
import types

import cloudpickle

from .errors import BadRequest
from .model_rules import OFFERED, call_with, has_forward, pipeline_units, repeated_blocks, sequential_children  # noqa: F401  (the SDK's names)


def fsdp_units_spec(units, model):
    """``fsdp_units`` as it travels: None (the automatic rule), a tuple of module classes, or a
    callable ``fn(module) -> bool`` that the ranks call on every module of the model."""
    if units is None:
        return None
    import torch
    if isinstance(units, type):
        units = [units]
    if isinstance(units, (list, tuple)):
        for unit in units:
            if not (isinstance(unit, type) and issubclass(unit, torch.nn.Module)):
                raise BadRequest(f"fsdp_units must be torch.nn.Module classes or a function fn(module) -> bool; "
                                 f"{unit!r} is not a module class", field="fsdp_units")
        if units and not any(isinstance(m, tuple(units)) for m in model.modules()):
            raise BadRequest(f"fsdp_units: the model has no module of class "
                             f"{', '.join(u.__name__ for u in units)}", field="fsdp_units")
        return tuple(units)
    if callable(units):
        return units
    raise BadRequest(f"fsdp_units must be a list of torch.nn.Module classes or a function fn(module) -> bool, "
                     f"got {type(units).__name__}", field="fsdp_units")


def units_said(units: list, kind: str) -> str:
    """``4 repeated blocks`` or ``6 children of its nn.Sequential (the model itself)``, for messages."""
    if not units:
        return "no repeated blocks and no nn.Sequential"
    if kind == "children":
        return f"{len(units)} children of its nn.Sequential ({units[0][0].rpartition('.')[0] or 'the model itself'})"
    return f"{len(units)} repeated blocks"


def check_pipeline(model, plan, stages: int) -> None:
    """A PIPELINE job's ``stage_plan`` (or, left out, the default plan) against the model: the
    modules it names exist; its ranges cover the model's units (``pipeline_units``); with no
    plan, the model has units enough for ``stages``. ``BadRequest`` naming ``pipeline.stage_plan``."""
    field = "pipeline.stage_plan"
    if plan is not None and isinstance(plan[0], str):
        known = {name for name, _ in model.named_modules()}
        missing = [name for name in plan if name not in known]
        if missing:
            raise BadRequest(f"field '{field}': the model has no module {missing[0]!r}", field=field)
        return
    units, kind = pipeline_units(model)
    if plan is not None:
        if plan[-1][1] != len(units):
            raise BadRequest(f"field '{field}': the ranges end at block {plan[-1][1]}, but the model has "
                             f"{units_said(units, kind)}: they must cover them all", field=field)
        return
    if not units and stages > 1:
        raise BadRequest(f"field '{field}': {type(model).__name__} has no repeated blocks and no nn.Sequential "
                         f"for the default plan to cut into {stages} stages: name the modules where stages 2.. "
                         f"begin (stage_plan=['layer3', ...])", field=field)
    if stages > 1 and len(units) < stages:
        raise BadRequest(f"field '{field}': the model's {units_said(units, kind)} cannot make {stages} stages: use "
                         f"fewer ranks, or name the modules where stages 2.. begin", field=field)


def check_devices(mixed: bool, global_batch, data_loader_func) -> None:
    """A mixed-devices job (``devices="mixed"``) tells ``data_loader_func`` its share of the
    global batch (``batch_size``) and a ``sampler``; only such a job does. ``BadRequest`` naming
    ``data_loader_func`` or ``global_batch``."""
    try:
        params = inspect.signature(data_loader_func).parameters
    except (TypeError, ValueError):
        return
    name = _fn_name(data_loader_func)
    if not mixed:
        needed = [n for n in ("batch_size", "sampler") if n in params and params[n].default is params[n].empty]
        if needed:
            raise BadRequest(f"data_loader_func {name!r} needs {_quoted(needed, 'argument')}, which zwdx gives only "
                             f"to a job over mixed devices (devices=\"mixed\"): give it a default",
                             field="data_loader_func")
        return
    if "batch_size" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        raise BadRequest(f"devices=\"mixed\": data_loader_func {name!r} must declare batch_size, its rank's share "
                         f"of the global batch (and use sampler, which cuts every global batch into the shares)",
                         field="data_loader_func")
    default = params["batch_size"].default if "batch_size" in params else None
    if global_batch is None and (not isinstance(default, int) or isinstance(default, bool) or default < 1):
        raise BadRequest("devices=\"mixed\" needs global_batch (the samples of one step over every rank), or a "
                         "default for data_loader_func's batch_size (then the global batch is the world size times "
                         "it)", field="global_batch")


def check_tp_plan(model, plan, parallelism: str) -> None:
    """A TP or FSDP+TP job's ``tp_plan`` against the model (``zwdx.tp_plan.resolve``), or, left
    out, that a plan can be derived from it. ``BadRequest`` naming ``tp_plan``."""
    from . import tp_plan
    if plan is not None:
        try:
            tp_plan.resolve(model, plan)
        except ValueError as exc:
            raise BadRequest(f"field 'tp_plan': {exc}", field="tp_plan") from None
        return
    derived, skipped = tp_plan.derive(model)
    if not derived:
        raise BadRequest(tp_plan.no_pairs(model, parallelism, skipped), field="tp_plan")


def _fn_name(fn) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def unmet_arguments(fn, offered) -> tuple[list[str], list[str]]:
    """The arguments of ``fn`` that zwdx cannot fill by name from ``offered``: required ones it
    does not offer, and required positional-only ones. A default, ``*args`` or ``**kwargs`` is fine."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return [], []
    missing, positional = [], []
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.kind is p.POSITIONAL_ONLY:
            positional.append(p.name)
        elif p.name not in offered:
            missing.append(p.name)
    return missing, positional


def check_signature(fn, what: str) -> None:
    """``BadRequest`` naming ``fn`` if a rank could not call it with the arguments zwdx offers."""
    offered = OFFERED[what]
    missing, positional = unmet_arguments(fn, offered)
    if missing:
        raise BadRequest(f"{what} {_fn_name(fn)!r} declares {_quoted(missing, 'argument')}, which zwdx does "
                         f"not provide: give it a default, or declare only some of {', '.join(offered)}",
                         field=what)
    if positional:
        raise BadRequest(f"{what} {_fn_name(fn)!r} declares {_quoted(positional, 'positional-only argument')}; "
                         f"zwdx passes arguments by name", field=what)


def _quoted(names: list[str], noun: str) -> str:
    return f"{noun}{'s' if len(names) > 1 else ''} " + ", ".join(f"'{n}'" for n in names)


# -- naming what cannot be pickled ---------------------------------------------------------------
pickle_errors = (pickle.PicklingError, TypeError, AttributeError, ValueError, NotImplementedError, RecursionError)


def _pickle_error(value) -> BaseException | None:
    try:
        cloudpickle.dumps(value, protocol=5)
    except pickle_errors as exc:
        return exc
    return None


def _inner(value) -> list[tuple[str, object]]:
    """The named values that pickling ``value`` pickles too: a function's closure and globals,
    a module's attributes (its parameters and buffers aside) and submodules."""
    if isinstance(value, types.FunctionType):
        try:
            found = inspect.getclosurevars(value)
        except ValueError:  # an empty closure cell
            return []
        return [*found.nonlocals.items(), *found.globals.items()]
    if hasattr(value, "_modules") and hasattr(value, "_parameters"):  # a torch.nn.Module
        plain = [(k, v) for k, v in vars(value).items() if not k.startswith("_")]
        return [*plain, *value._modules.items()]
    return []


def _culprit(value, depth: int = 0) -> tuple[list[str], object, BaseException] | None:
    """The path to the innermost named value under ``value`` that cannot be pickled."""
    error = _pickle_error(value)
    if error is None:
        return None
    if depth < 4:
        for name, inner in _inner(value):
            found = _culprit(inner, depth + 1)
            if found is not None:
                return [name, *found[0]], found[1], found[2]
    return [], value, error


def unpicklable_error(exc: BaseException, model, functions: dict) -> BadRequest:
    for what, fn in functions.items():
        found = _culprit(fn) if fn is not None else None
        if found and found[0]:
            path, value, error = found
            kind = f"{type(value).__module__}.{type(value).__qualname__}"
            via = f" (through {' -> '.join(path[:-1])})" if len(path) > 1 else ""
            return BadRequest(f"{what} {_fn_name(fn)!r} uses variable {path[-1]!r}{via} of type {kind}, which "
                              f"cannot be pickled to send to GPU clients ({error}); create it inside the "
                              f"function instead", field=what, variable=path[-1], variable_type=kind)
    found = _culprit(model)
    if found and found[0]:
        path, value, error = found
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        return BadRequest(f"model attribute 'model.{'.'.join(path)}' of type {kind} cannot be pickled to send "
                          f"to GPU clients ({error})", field="model", variable=".".join(path), variable_type=kind)
    return BadRequest(f"the job (model, functions, optimizer) cannot be pickled to send to GPU clients: "
                      f"{type(exc).__name__}: {exc}")
