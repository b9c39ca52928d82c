"""zwdx: pool GPUs that people lend, and train PyTorch models on them.

Public surface: ``ZWDX`` (the SDK), the settings a job is submitted with (``DDP``, ``FSDP``, ``TP``,
``TensorParallel``, ``Pipeline``, ``Diloco``, ``Mixed``, ``Auto``, ``Resources``, ``Recovery``, ``Training``,
``Run``: ``zwdx.sdk.settings``), ``JobStatus`` and the errors.

The SDK (and with it requests, socket and ssl) is imported on first use of ``ZWDX``, so that
``zwdx server`` can hand sockets and threads to gevent before anything imports them.
"""
from .errors import (AuthError, BadRequest, Conflict, InsufficientStorage, JobFailed, NotFound, QuotaExceeded,
                     RateLimited, ServerUnreachable, Unschedulable, ZwdxError)
from .protocol import JobStatus

__version__ = "0.1.0"

#: The settings objects (``zwdx.sdk.settings``), imported with the SDK on first use.
SETTINGS = ("DDP", "FSDP", "TP", "TensorParallel", "Pipeline", "Diloco", "Mixed", "Auto", "Resources", "Recovery",
            "Training", "Run")

__all__ = ["ZWDX", *SETTINGS, "JobStatus", "ZwdxError", "AuthError", "BadRequest", "Conflict", "JobFailed", "NotFound",
           "InsufficientStorage", "QuotaExceeded", "RateLimited", "ServerUnreachable", "Unschedulable", "__version__"]


def __getattr__(name: str):
    if name == "ZWDX":
        from .sdk import ZWDX
        globals()["ZWDX"] = ZWDX
        return ZWDX
    if name in SETTINGS:
        from .sdk import settings
        globals()[name] = getattr(settings, name)
        return globals()[name]
    raise AttributeError(f"module 'zwdx' has no attribute {name!r}")
