"""The job bundle: the submitter's model, functions and optimizer settings, cloudpickled.

Code from the submitter's own modules (anything not installed in site-packages or the
standard library) travels by value, so a GPU client needs the packages but not the
submitter's source tree. The optimizer travels as its class and every param group's
hyperparameters and is rebuilt on each rank over the wrapped model's parameters.

Only GPU clients unpickle a bundle; the server stores and forwards its bytes untouched.
"""
from __future__ import annotations

import copy
import importlib
import inspect
import io
import logging
import os
import sys
import sysconfig
import types

import cloudpickle

from .errors import BadRequest
from .protocol import runtime_versions

log = logging.getLogger(__name__)

FORMAT = 1


def _installed_roots() -> list[str]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")))
    return [os.path.realpath(r) for r in roots]


def is_user_module(module: types.ModuleType | None) -> bool:
    """True for modules of the submitter's own source tree (not stdlib, not installed)."""
    if module is None or module.__name__ == "__main__":
        return False  # __main__ is pickled by value already
    path = getattr(module, "__file__", None)
    if not path:
        return False
    path = os.path.realpath(path)
    return not any(path.startswith(root + os.sep) for root in _installed_roots()) and \
        not module.__name__.startswith(("zwdx", "gpu_client", "torch", "cloudpickle"))


def _referenced(obj, seen: set, found: dict, depth: int = 0) -> None:
    """Collect user modules that ``obj`` (a function, class or module) reaches through globals."""
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        if is_user_module(obj):
            found[obj.__name__] = obj
        return
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if is_user_module(module):
        found[module.__name__] = module
    if isinstance(obj, type):
        for base in obj.__mro__[1:]:
            _referenced(base, seen, found, depth + 1)
        for value in vars(obj).values():
            if isinstance(value, (types.FunctionType, staticmethod, classmethod)):
                _referenced(getattr(value, "__func__", value), seen, found, depth + 1)
        return
    code = getattr(obj, "__code__", None)
    if code is None:
        return
    names, stack = set(), [code]
    while stack:
        c = stack.pop()
        names.update(c.co_names)
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    globs = getattr(obj, "__globals__", {})
    for name in names:
        value = globs.get(name)
        if isinstance(value, (types.FunctionType, type, types.ModuleType)):
            _referenced(value, seen, found, depth + 1)


def optimizer_spec(optimizer, model) -> dict | None:
    """An optimizer as its class and every param group's settings, with the model's parameter
    names where the group's parameters belong to ``model`` (else None: all parameters)."""
    if optimizer is None:
        return None
    if not hasattr(optimizer, "param_groups"):
        raise BadRequest("optimizer must be a torch.optim.Optimizer instance", field="optimizer")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        pnames = [names.get(id(p)) for p in group["params"]]
        groups.append({"hyper": hyper, "params": pnames if pnames and all(pnames) else None})
    return {"cls": type(optimizer), "groups": groups}


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, plus modules whose type subclasses ModuleType (torch.backends.cudnn and its
    siblings replace themselves in sys.modules so): by name, as plain modules go. Without it a
    train_func that sets ``torch.backends.cudnn.benchmark`` cannot be submitted."""

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and type(obj) is not types.ModuleType:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def pack(model, data_loader_func, train_func, eval_func=None, optimizer=None) -> bytes:
    """Cloudpickle what a rank needs into bytes."""
    for name, fn in (("data_loader_func", data_loader_func), ("train_func", train_func)):
        if not callable(fn):
            raise BadRequest(f"{name} must be a function, got {type(fn).__name__}", field=name)
    if eval_func is not None and not callable(eval_func):
        raise BadRequest(f"eval_func must be a function or None, got {type(eval_func).__name__}", field="eval_func")
    if not hasattr(model, "state_dict") or not hasattr(model, "parameters"):
        raise BadRequest(f"model must be a torch.nn.Module, got {type(model).__name__}", field="model")
    found: dict[str, types.ModuleType] = {}
    seen: set = set()
    for obj in (data_loader_func, train_func, eval_func, *{type(m) for m in model.modules()}):
        if obj is not None:
            _referenced(obj, seen, found)
    spec = optimizer_spec(optimizer, model)
    payload = {"format": FORMAT, "model": copy.deepcopy(model).cpu(), "data_loader_func": data_loader_func,
               "train_func": train_func, "eval_func": eval_func, "optimizer": spec,
               "versions": runtime_versions()}
    for module in found.values():
        cloudpickle.register_pickle_by_value(module)
    try:
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=5).dump(payload)
        return buffer.getvalue()
    finally:
        for module in found.values():
            cloudpickle.unregister_pickle_by_value(module)


def unpack(data: bytes) -> dict:
    """Load a bundle (GPU clients only: this runs the submitter's code)."""
    payload = cloudpickle.loads(data)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError("not a zwdx job bundle of a format this gpu client understands")
    return payload


def call_with(fn, available: dict, what: str):
    """Call ``fn`` with the named arguments it declares, taken from ``available``."""
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
