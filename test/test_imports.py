"""The import contracts of pyproject.toml ([tool.importlinter]) hold: the SDK side and the GPU
client never import the server, the protocol imports nothing of zwdx beyond errors and
defaults, and server modules import only downward (edges, http, job lifecycle, rules and
views, storage), never the zwdx.server package that builds the app from them; the GPU client's
folders import downward (agent, sandbox, rank, shared helpers) with no cycle, and never the SDK."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import needs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINT = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"

needs.module("importlinter", "pip install import-linter (pip install -e '.[test]')")


def lint(root: str) -> subprocess.CompletedProcess:
    """lint-imports on the tree at ``root`` (its pyproject.toml, its packages first on sys.path)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, "-c", LINT], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_the_import_contracts_hold():
    done = lint(ROOT)
    assert done.returncode == 0, f"an import breaks a contract of pyproject.toml:\n{done.stdout}\n{done.stderr}"
    assert "0 broken" in done.stdout


@pytest.mark.parametrize("path, line, says", [
    ("gpu_client/gpus.py", "from zwdx.server import http", "gpu_client is not allowed to import zwdx.server"),
    ("zwdx/protocol/job.py", "from .. import credentials", "zwdx.protocol is not allowed to import zwdx.credentials"),
    ("zwdx/server/notify.py", "from . import api", "zwdx.server.notify is not allowed to import zwdx.server.api"),
    ("zwdx/server/checkpoints.py", "from .api import bp", "zwdx.server.checkpoints is not allowed to import "
                                                          "zwdx.server.api"),
    ("zwdx/server/jobs/lifecycle.py", "from .. import create_app", "zwdx.server.jobs.lifecycle is not allowed to "
                                                                   "import zwdx.server"),
    ("zwdx/server/jobs/model.py", "from . import effects", "zwdx.server.jobs.model is not allowed to import "
                                                           "zwdx.server.jobs.effects"),
    ("zwdx/server/store/gridfs.py", "from .. import artifacts", "zwdx.server.store is not allowed to import "
                                                                "zwdx.server.artifacts"),
    ("gpu_client/rank/runner.py", "from gpu_client.sandbox import rank_process", "gpu_client.rank is not allowed to "
                                                                                 "import gpu_client.sandbox"),
    ("gpu_client/rank/strategies/layout.py", "from zwdx import checks", "gpu_client is not allowed to import "
                                                                        "zwdx.checks"),
    ("gpu_client/rank/strategies/parallel.py", "from . import diloco", "No cycles are allowed in "
                                                                       "gpu_client.rank.strategies"),
])
def test_a_bad_import_breaks_a_contract(tmp_path, path, line, says):
    """The same contracts on a copy of the tree with one import that breaks them."""
    for name in ("zwdx", "gpu_client"):
        shutil.copytree(os.path.join(ROOT, name), tmp_path / name,
                        ignore=shutil.ignore_patterns("__pycache__", "ui_dist"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
    with open(tmp_path / path, "a") as fh:
        fh.write(f"\n{line}\n")
    done = lint(str(tmp_path))
    assert done.returncode != 0, done.stdout
    assert says in " ".join(done.stdout.split()), done.stdout
