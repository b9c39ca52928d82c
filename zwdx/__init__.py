"""zwdx: pool GPUs that people lend, and train PyTorch models on them.

Public surface: ``ZWDX`` (the SDK), ``JobStatus`` and the errors.
"""
from .errors import (AuthError, BadRequest, Conflict, JobFailed, NotFound, RoomNotFound, ServerUnreachable,
                     ZwdxError)
from .protocol import JobStatus
from .sdk import ZWDX

__version__ = "0.1.0"

__all__ = ["ZWDX", "JobStatus", "ZwdxError", "AuthError", "BadRequest", "Conflict", "JobFailed", "NotFound",
           "RoomNotFound", "ServerUnreachable", "__version__"]
