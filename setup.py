"""Build hook: the wheel carries the dashboard's production build, so that a server installed
with `pip install zwdx` serves it with no Node on that machine (metadata: pyproject.toml).

``build_py`` copies ``ui/dist`` into the package as ``zwdx/server/ui_dist``. When ``ui/dist``
is missing or older than the dashboard's sources and npm is there, it builds it first (``npm
ci`` when ``ui/node_modules`` is missing, then ``npm run build``: seconds). With neither a
build nor npm it stops with a message saying what to do; ``ZWDX_BUILD_WITHOUT_DASHBOARD=1``
builds the package without the dashboard instead. An editable install (``pip install -e .``)
copies nothing: the server serves the checkout's ``ui/dist``.
"""
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

UI = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui")
DIST = os.path.join(UI, "dist")


def _newest_source() -> float:
    paths = [os.path.join(UI, name) for name in ("index.html", "package.json", "package-lock.json", "vite.config.js")]
    for folder in ("src", "public"):
        for base, _, files in os.walk(os.path.join(UI, folder)):
            paths += [os.path.join(base, f) for f in files]
    return max((os.path.getmtime(p) for p in paths if os.path.exists(p)), default=0.0)


def _say(message: str) -> None:
    print(f"zwdx build: {message}", file=sys.stderr, flush=True)


def dashboard_build() -> str | None:
    """``ui/dist``, built first if it is missing or stale and npm is there; None when the package
    is to be built without it."""
    index = os.path.join(DIST, "index.html")
    fresh = os.path.exists(index) and os.path.getmtime(index) >= _newest_source()
    npm = shutil.which("npm")
    if not fresh and npm and os.path.exists(os.path.join(UI, "package.json")):
        if not os.path.isdir(os.path.join(UI, "node_modules")):
            _say("installing the dashboard's build tools (npm ci)")
            subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"], cwd=UI, check=True)
        _say("building the dashboard (npm run build)")
        subprocess.run([npm, "run", "build", "--silent"], cwd=UI, check=True)
    elif not fresh and os.path.exists(index):
        _say("WARNING: ui/dist is older than the dashboard's sources and npm is missing; packaging it as it is")
    if os.path.exists(index):
        return DIST
    if os.environ.get("ZWDX_BUILD_WITHOUT_DASHBOARD") == "1":
        _say("WARNING: building without the dashboard (ZWDX_BUILD_WITHOUT_DASHBOARD=1): the server will "
             "serve only the API unless given --ui-dir")
        return None
    sys.exit("zwdx build: the dashboard is not built (no ui/dist/index.html) and npm is missing. Install "
             "Node 20 with npm, or build ui/dist elsewhere (cd ui && npm ci && npm run build), or set "
             "ZWDX_BUILD_WITHOUT_DASHBOARD=1 to build the package without the dashboard.")


class BuildPy(build_py):
    """build_py, plus the dashboard's build as package data."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        source = dashboard_build()
        target = os.path.join(self.build_lib, "zwdx", "server", "ui_dist")
        shutil.rmtree(target, ignore_errors=True)  # nothing of an earlier build left behind
        if source:
            shutil.copytree(source, target)
            _say(f"dashboard packaged as zwdx/server/ui_dist ({len(os.listdir(target))} entries)")


setup(cmdclass={"build_py": BuildPy})
