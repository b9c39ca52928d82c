"""The flat shape of a job's spec, as zwdx wrote it before the tree (``zwdx.protocol.spec``):
one field per option (``parallelism``, ``world_size``, ``diloco``, ``tp_plan``, ...). Earlier SDKs
still send it and stores still hold records of it; ``nest`` reads either as the tree.

A flat body is checked as it was (``check``: an option its mode does not take is named by its flat
name, as before), and the errors of its tree name the flat fields (``flat_loc``), so that a caller
of ``submit_job(tp_plan=...)`` is told about ``tp_plan``.
"""
from __future__ import annotations

from typing import Any, NoReturn

from pydantic import ValidationError

from .vocab import JobKind, Parallelism

PARTS = {"code": ("bundle_artifact", "bundle_sha256", "bundle_size", "versions", "required_modules"),
         "resources": ("world_size", "memory_required", "gpus_per_client", "image"),
         "recovery": ("min_world_size", "max_restarts", "keep_checkpoints", "checkpoint_every_epoch"),
         "training": ("epochs", "collective_timeout")}  # frozen: a new option is the tree's only
_OPTIONS = ("diloco", "pipeline", "lora", "global_batch", "tp_plan", "tp_size", "devices")
_TYPES = {"DDP": "ddp", "FSDP": "fsdp", "FSDP+TP": "fsdp", "TP": "tp", "PIPELINE": "pipeline", "DILOCO": "diloco",
          "AUTO": "auto"}
_TP = {"plan": "tp_plan", "size": "tp_size"}
#: The flat body's fields in the order its model declared them: the order its errors came in.
FIELDS = ("versions", "bundle_artifact", "kind", "parallelism", "epochs", "world_size", "memory_required", "name",
          "collective_timeout", "min_world_size", "max_restarts", "keep_checkpoints", "checkpoint_every_epoch",
          "required_modules", "fail_if_unschedulable", "script", "gpus_per_client", "diloco", "pipeline", "lora",
          "datasets", "image", "devices", "global_batch", "tp_plan", "tp_size")


def fail(loc: tuple[Any, ...], message: str, value: Any = None) -> NoReturn:
    """A validation error at ``loc`` (inside the model being validated), saying ``message``."""
    raise ValidationError.from_exception_data("JobSpec", [
        {"type": "value_error", "loc": loc, "input": value, "ctx": {"error": ValueError(message)}}])


def _value(x: Any) -> str:
    return str(getattr(x, "value", x))


def _strategy(flat: dict[str, Any]) -> dict[str, Any]:
    """The ``strategy`` of a flat spec (popped from it)."""
    kind, script = _value(flat.pop("kind", JobKind.FUNCTION.value)), flat.pop("script", None)
    parallelism = _value(flat.pop("parallelism", Parallelism.DDP.value)).upper()
    options = {k: v for k, v in ((k, flat.pop(k)) for k in _OPTIONS if k in flat) if v is not None}
    if "devices" in options:
        options["devices"] = _value(options["devices"]).lower()
        if options["devices"] == "same":
            options.pop("devices")
    if kind == JobKind.SCRIPT.value:
        return {**(script if isinstance(script, dict) else {}), **options, "type": "script"}
    if script is not None:
        options["script"] = script
    if parallelism == "DDP" and options.get("devices") == "mixed":
        options.pop("devices")
        return {**options, "type": "mixed"}
    if parallelism in ("TP", "FSDP+TP"):
        tp = {"plan": options.pop("tp_plan", None), "size": options.pop("tp_size", None)}
        if parallelism == "TP":
            return {**options, **tp, "type": "tp"}
        options["tp"] = tp
    own = {"PIPELINE": "pipeline", "DILOCO": "diloco"}.get(parallelism)
    settings = options.pop(own, None) if own else None
    return {**(settings if isinstance(settings, dict) else {}), **options, "type": _TYPES.get(parallelism, parallelism)}


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    """A spec of the flat shape as the tree; a tree as it is."""
    if "strategy" in flat or "code" in flat:
        return flat
    flat = dict(flat)
    tree: dict[str, Any] = {part: {k: flat.pop(k) for k in keys if k in flat} for part, keys in PARTS.items()}
    tree["strategy"] = _strategy(flat)
    return {**flat, **tree}


def check(flat: dict[str, Any]) -> None:
    """A flat body's options against its mode, as the flat ``SubmitJob`` checked them (the tree
    refuses the same structurally, as an unknown field of the strategy)."""
    given = {k: v for k, v in flat.items() if v is not None}
    parallelism = _value(given.get("parallelism", "DDP")).upper()
    if parallelism not in _TYPES:
        fail(("parallelism",), f"must be one of {', '.join(repr(p) for p in _TYPES)}, got {parallelism!r}", parallelism)
    script = _value(given.get("kind", JobKind.FUNCTION.value)) == JobKind.SCRIPT.value
    devices = _value(given.get("devices", "same")).lower()
    if devices not in ("same", "mixed"):
        fail(("devices",), f"must be 'same' or 'mixed', got {devices!r}", given["devices"])
    _script_rules(given, script, parallelism)
    _option_rules(given, parallelism, script, devices == "mixed")


def _script_rules(given: dict[str, Any], script: bool, parallelism: str) -> None:
    """A script job names its script, runs no PIPELINE; a job of functions names none."""
    if script and "script" not in given:
        fail(("script",), "a script job needs its script: {\"path\", \"args\", \"env\"}")
    if not script and "script" in given:
        fail(("script",), "only a job of kind \"script\" runs a script", given["script"])
    if script and parallelism == "PIPELINE":
        fail(("pipeline",), "a script job has no model to cut into stages: PIPELINE is for submit_job's functions")


def _option_rules(given: dict[str, Any], parallelism: str, script: bool, mixed: bool) -> None:
    """Each mode's own options only with that mode (DILOCO's, PIPELINE's, LoRA, mixed devices, TP's)."""
    for option, modes in (("diloco", ("DILOCO",)), ("pipeline", ("PIPELINE",))):
        if option in given and parallelism not in modes:
            fail((option,), f"applies to parallelism {modes[0]} only, not {parallelism}", given[option])
    if "lora" in given and (parallelism not in ("DDP", "FSDP") or script):
        fail(("lora",), f"LoRA jobs run with DDP or FSDP, not {parallelism}", given["lora"])
    if mixed and script:
        fail(("devices",), "devices \"mixed\" weighs the batches of submit_job's functions; a script job runs its "
                           "own loop", "mixed")
    if mixed and parallelism != "DDP":
        fail(("devices",), f"devices \"mixed\" runs with DDP only, not {parallelism}", "mixed")
    if "global_batch" in given and not mixed:
        fail(("global_batch",), "applies to devices \"mixed\" only (the batch is shared out by the ranks' speed)",
             given["global_batch"])
    for option in ("tp_plan", "tp_size"):
        if option in given and (parallelism not in ("TP", "FSDP+TP") or script):
            fail((option,), f"applies to parallelism TP and FSDP+TP only, not {parallelism}", given[option])


def flat_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Where an error of the tree is, in the flat shape: ``("resources", "world_size")`` ->
    ``("world_size",)``, ``("strategy", "tp", "plan")`` -> ``("tp_plan",)``."""
    if not loc or loc[0] not in ("strategy", *PARTS):
        return loc
    head, rest = loc[0], tuple(loc[1:])
    if head != "strategy":
        return rest or (head,)
    if not rest:
        return ("parallelism",)
    tag, rest = rest[0], rest[1:]
    if rest[:1] == ("tp",):
        tag, rest = "tp", rest[1:]
    if tag == "tp" and rest and rest[0] in _TP:
        return (_TP[rest[0]], *rest[1:])
    if tag in ("pipeline", "diloco", "script"):
        return (tag, *rest)
    return rest or ("parallelism",)


def flat_errors(exc: ValidationError, prefix: tuple[Any, ...]) -> ValidationError:
    """``exc`` with each error's place (under ``prefix``) as the flat shape names it, in the order
    the flat model listed them (``FIELDS``; unknown fields last)."""
    details: list[Any] = []
    for error in exc.errors(include_url=False):
        loc = tuple(error["loc"])
        if loc[:len(prefix)] == prefix:
            loc = flat_loc(loc[len(prefix):])
        details.append({"type": error["type"], "loc": loc, "input": error.get("input"),
                        **({"ctx": error["ctx"]} if error.get("ctx") else {})})
    rank = {name: i for i, name in enumerate(FIELDS)}
    details.sort(key=lambda d: rank.get(str(d["loc"][0]) if d["loc"] else "", len(rank)))
    return ValidationError.from_exception_data(exc.title, details)


__all__ = ["PARTS", "fail", "nest", "check", "flat_loc", "flat_errors"]
