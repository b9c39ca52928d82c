"""What a test needs from the machine: a tool, a Python package, a privilege, a resource.

Every test that cannot run without something of the machine asks here. Where it is missing the
test is skipped on a developer's machine and fails under CI (the ``CI`` variable set, as
``.ci/run`` does), both saying what is missing and how to get it: CI installs everything
(``./setup.sh --test``), so there a missing tool is a broken CI, not a reason to run less.
conftest's session hook fails a CI run that skipped anything at all, whatever the reason.

    tool("chromium", "apt-get install chromium")  -> its path
    module("playwright.sync_api")                  -> the module
    root("network namespaces")                     -> None, or skip/fail
    missing(what, how)                             -> skip/fail, saying what and how
"""
from __future__ import annotations

import importlib
import os
import shutil
from typing import NoReturn

import pytest

#: The usual way to get what the test suite needs.
SETUP = "./setup.sh --test installs it"


def in_ci() -> bool:
    """Whether this run is CI's, where nothing may be skipped."""
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def missing(what: str, how: str = SETUP) -> NoReturn:
    """This test cannot run here: fail under CI, skip elsewhere, saying ``what`` is missing and
    ``how`` to get it. Works in a test, a fixture, or at a module's top."""
    message = f"{what} is missing: {how}"
    if in_ci():
        pytest.fail(f"{message} (CI runs every test: install it there)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


def tool(name: str, how: str = SETUP) -> str:
    """The path of command ``name`` (found on PATH, as ``command -v`` finds it)."""
    path = shutil.which(name)
    if path is None:
        missing(f"the command {name}", how)
    return path


def module(name: str, how: str | None = None):
    """Python module ``name``, imported."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(f"the Python module {name} ({exc})", how or f"pip install -e '.[test]' ({SETUP})")


def root(why: str) -> None:
    """This process runs as root (``why`` says what for)."""
    if os.geteuid() != 0:
        missing(f"root ({why})", "run the suite as root, as CI does")


def cuda(gpus: int = 1) -> None:
    """At least ``gpus`` NVIDIA GPUs that torch can use."""
    import torch
    if torch.cuda.device_count() < gpus:
        missing(f"{gpus} CUDA GPU(s) (torch sees {torch.cuda.device_count()})",
                "run on a GPU machine: python -m pytest -m gpu")


def leave_out_gpu_tests(config, items: list) -> None:
    """Deselect the ``gpu`` tests where torch sees no GPU, so that a run without GPUs (CI's)
    neither fails nor skips them, and says so. Kept where asked for: ``-m`` names gpu, or the
    test's file is named on the command line (then ``cuda()`` skips, or fails under CI)."""
    gpu = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu or "gpu" in (config.option.markexpr or ""):
        return
    gpu = [item for item in gpu if not item.session.isinitpath(item.path)]
    if not gpu:
        return
    import torch
    if torch.cuda.is_available():
        return
    config.hook.pytest_deselected(items=gpu)
    items[:] = [item for item in items if item not in gpu]
    config.pluginmanager.register(_Said(len(gpu)), "zwdx-gpu-deselected")


class _Said:
    def __init__(self, count: int):
        self.count = count

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line(f"{self.count} GPU test(s) deselected: torch sees no CUDA device "
                                    "(on a GPU machine: python -m pytest -m gpu)")
