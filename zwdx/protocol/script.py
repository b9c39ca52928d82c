"""A script job: an existing ``torchrun`` script run unchanged on a room's slots (``zwdx run``).

The submitter's working dir travels as a plain archive (a gzipped tar, ``zwdx.workdir``),
never as a pickle: an artifact of the room found by its sha256 (``PUT /api/v1/workdirs/<sha256>``),
so an unchanged tree is uploaded once. The job names it as its ``bundle_artifact`` and says
what to run in a ``ScriptSpec``; each rank unpacks the tree into a private folder and runs
``python PATH ARGS...`` there with torchrun's environment (``TORCHRUN_VARIABLES`` and the
``ZWDX_*`` ones, set by ``gpu_client.rank.script``), so a name here may be none of those.

What the edge checks (a wrong one is a 400 naming the field, nothing stored):

- ``path``: relative, inside the tree (no ``..``, no leading ``/`` or ``-``), at most 1,024 characters;
- ``args``: at most 1,000 strings of at most 10,000 characters each (no NUL);
- ``env``: at most 200 names ``[A-Z_][A-Z0-9_]*``, none that zwdx sets, values as ``args``;
- ``outputs_from``: at most 16 folders of the tree, each as ``path`` (relative, no ``..``);
- ``left_out``: at most 1,000 names of at most 1,024 characters (no NUL).

``$ZWDX_OUTPUT_DIR`` and ``$ZWDX_DATA_DIR`` (or ``${...}``) in ``args`` are the rank's own
folders, put in by the GPU client (``EXPANDED``: those two only, never other variables).
"""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import ConfigDict, Field, StringConstraints, field_validator

from .base import Message

#: Variables torchrun gives each worker (torch.distributed.elastic's local agent); zwdx sets
#: them the same way for every rank of a script job.
TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                      "TORCHELASTIC_MAX_RESTARTS")
#: What else zwdx sets in a script's environment: which GPUs it sees, its output stays live, its
#: ranks talk over the interface that reaches the server.
SET_BY_ZWDX = ("CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: Prefixes of names zwdx owns (``ZWDX_OUTPUT_DIR``, ...) or torchrun's agent does.
RESERVED_PREFIXES = ("ZWDX_", "TORCHELASTIC_")

#: The variables a script's arguments may name (``$NAME`` or ``${NAME}``), replaced on the GPU
#: client by the rank's own folders: the submitter cannot know the donor's paths.
EXPANDED = ("ZWDX_OUTPUT_DIR", "ZWDX_DATA_DIR")
#: One of them in an argument: group 1 the ``${NAME}`` form, group 2 the ``$NAME`` one.
VARIABLE = re.compile(r"\$(?:\{(%s)\}|(%s)(?![A-Za-z0-9_]))" % ("|".join(EXPANDED), "|".join(EXPANDED)))
#: Most folders ``outputs_from`` names; most names ``left_out`` holds.
MAX_OUTPUTS_FROM = 16
MAX_LEFT_OUT = 1000

#: Most arguments, environment variables; longest argument or value; longest script path.
MAX_ARGS = 1000
MAX_ENV = 200
MAX_ARG_CHARS = 10_000
MAX_PATH_CHARS = 1024

#: An argument or an environment value: any text a command line can carry (no NUL).
Arg = Annotated[str, StringConstraints(max_length=MAX_ARG_CHARS, pattern=r"^[^\x00]*$")]
#: An environment variable's name as shells write them.
EnvName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Z_][A-Z0-9_]*$")]


def reserved(name: str) -> bool:
    """Whether zwdx (or torchrun's environment) sets ``name`` for every rank."""
    return name in TORCHRUN_VARIABLES or name in SET_BY_ZWDX or name.startswith(RESERVED_PREFIXES)


def script_path_error(path: str) -> str | None:
    """Why ``path`` cannot name a script inside the working dir (None: it can)."""
    parts = path.split("/")
    if not path or len(path) > MAX_PATH_CHARS:
        return f"must be 1 to {MAX_PATH_CHARS} characters"
    if "\x00" in path or "\\" in path:
        return "must be a POSIX path (no NUL, no backslash)"
    if path.startswith("/"):
        return "must be relative to the working dir, not absolute"
    if path.startswith("-"):
        return "must not start with '-' (python would read it as an option)"
    if any(part in ("", ".", "..") for part in parts):
        return "must stay inside the working dir (no '..', '.' or empty parts)"
    return None


class ScriptSpec(Message):
    """What a script job runs on every rank: ``python PATH ARGS...`` in the unpacked working
    dir, with ``env`` added to torchrun's environment."""
    #: The script, relative to the working dir (``train.py``, ``examples/ddp.py``).
    path: str
    args: Annotated[list[Arg], Field(max_length=MAX_ARGS)] = []
    env: Annotated[dict[EnvName, Arg], Field(max_length=MAX_ENV)] = {}
    #: Folders of the working dir (relative to the script's cwd) whose files rank 0 adds to the
    #: job's outputs, under the same names (``zwdx run --outputs-from out``).
    outputs_from: Annotated[list[str], Field(max_length=MAX_OUTPUTS_FROM, exclude_if=lambda v: not v)] = []
    #: What a ``.gitignore`` left out of the working dir (a folder as ``name/``): a script that
    #: fails opening one of them is told so.
    left_out: Annotated[list[Annotated[str, StringConstraints(max_length=MAX_PATH_CHARS, pattern=r"^[^\x00]+$")]],
                        Field(max_length=MAX_LEFT_OUT, exclude_if=lambda v: not v)] = []

    @field_validator("path")
    @classmethod
    def _inside(cls, path: str) -> str:
        error = script_path_error(path)
        if error:
            raise ValueError(error)
        return path

    @field_validator("outputs_from")
    @classmethod
    def _folders_inside(cls, folders: list[str]) -> list[str]:
        for folder in folders:
            error = script_path_error(folder.rstrip("/") or folder)
            if error:
                raise ValueError(f"{folder!r} {error}")
        return [folder.rstrip("/") for folder in folders]

    @field_validator("env")
    @classmethod
    def _not_ours(cls, env: dict[str, str]) -> dict[str, str]:
        ours = sorted(name for name in env if reserved(name))
        if ours:
            raise ValueError(f"must not set {', '.join(ours)}: zwdx sets it for every rank (torchrun's environment "
                             f"{', '.join(TORCHRUN_VARIABLES[:4])}, ..., {', '.join(SET_BY_ZWDX[:1])}, ZWDX_*)")
        return env


class ScriptRecord(ScriptSpec):
    """A ``ScriptSpec`` as a stored record holds it: read leniently (a field a newer zwdx added
    is ignored)."""
    model_config = ConfigDict(extra="ignore", strict=False)


__all__ = ["TORCHRUN_VARIABLES", "SET_BY_ZWDX", "RESERVED_PREFIXES", "EXPANDED", "VARIABLE", "MAX_OUTPUTS_FROM",
           "MAX_LEFT_OUT", "MAX_ARGS", "MAX_ENV", "MAX_ARG_CHARS",
           "MAX_PATH_CHARS", "Arg", "EnvName", "reserved", "script_path_error", "ScriptSpec", "ScriptRecord"]
