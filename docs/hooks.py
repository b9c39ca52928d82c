"""mkdocs hooks: the API reference pages, made at build time from what the code exports.

reference/sdk.md documents every name of ``zwdx.__all__`` and reference/protocol.md every module of
``zwdx.protocol``, so a name added, moved or removed changes the reference without an edit here.
"""
from __future__ import annotations

import importlib
import inspect
import pkgutil

from mkdocs.structure.files import File

# modules of zwdx.protocol that are tools, not messages
PROTOCOL_TOOLS = {"catalog", "js"}


def _path(obj) -> str:
    if inspect.ismodule(obj):
        return obj.__name__
    return f"{obj.__module__}.{obj.__qualname__}"


def sdk_page() -> str:
    zwdx = importlib.import_module("zwdx")
    lines = ["# SDK reference", "",
             "Every name `zwdx` exports (its `__all__`), from the docstrings. "
             "[The SDK](../sdk.md) is the guide.", ""]
    for name in zwdx.__all__:
        obj = getattr(zwdx, name)
        if isinstance(obj, (str, int, float, tuple)):
            lines += [f"## `zwdx.{name}`", "", f"`{obj!r}`", ""]
            continue
        lines += [f"::: {_path(obj)}", ""]
    return "\n".join(lines)


def protocol_page() -> str:
    protocol = importlib.import_module("zwdx.protocol")
    lines = ["# Protocol reference", "",
             "Every message between the SDK, the server, the GPU clients and the dashboard is declared once "
             "in `zwdx.protocol` (pydantic models and str enums), one module per subject. "
             "[Architecture](../architecture.md) follows one job by these messages; "
             "[Socket.IO events](../events.md) lists each event's payload.", ""]
    for info in sorted(pkgutil.iter_modules(protocol.__path__), key=lambda m: m.name):
        if info.name in PROTOCOL_TOOLS or info.name.startswith("_"):
            continue
        lines += [f"::: zwdx.protocol.{info.name}", "    options:", "      show_root_full_path: true",
                  "      heading_level: 2", "      members_order: source", ""]
    return "\n".join(lines)


def on_files(files, config):
    for uri, make in (("reference/sdk.md", sdk_page), ("reference/protocol.md", protocol_page)):
        files.append(File.generated(config, uri, content=make()))
    return files
