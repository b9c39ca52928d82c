"""Serves the dashboard's production build on the server's own port.

Where the build comes from, first found first: ``--ui-dir`` / ``ZWDX_UI_DIR`` (config
``UI_DIR``); ``zwdx/server/ui_dist``, which the wheel carries (setup.py copies ``ui/dist``
there when it builds the package); ``ui/dist`` beside the package, in a source checkout
(``pip install -e .`` after ``./setup.sh``, or the Docker image).

Files under /assets carry a content hash in their names and are cached for a year; any other
path that is not a file of the build is a client-side route and gets index.html (never
cached, so a new build shows up at the next load). A path that would leave the build's folder
(``..%2f``) is no file of it: it gets index.html too, whether something exists there or not,
so the answer tells nothing about the server's files.
"""
from __future__ import annotations

import logging
import os

from flask import Blueprint, current_app, send_from_directory
from werkzeug.security import safe_join

from ..errors import NotFound

log = logging.getLogger(__name__)

bp = Blueprint("ui", __name__)

#: The build inside the installed package, and the one of a source checkout.
PACKAGED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ui_dist")
CHECKOUT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "ui", "dist")

_MISSING = """<!doctype html><title>zwdx</title><h1>zwdx server</h1>
<p>The dashboard's build is missing (the server's log says where it looked).</p>
<p>An installed zwdx carries it; in a source checkout build it with <code>cd ui && npm ci && npm run build</code>
(<code>./setup.sh</code> does it), or point <code>zwdx server --ui-dir DIR</code> (or <code>ZWDX_UI_DIR</code>)
at a build.</p>
<p>The API is under <code>/api/v1</code>; <code>/health</code> tells whether the server is up.</p>"""

_YEAR = 365 * 24 * 3600


def _built(folder: str | None) -> bool:
    return bool(folder) and os.path.isfile(os.path.join(folder, "index.html"))


def find_dashboard(ui_dir: str | None = None) -> str:
    """The folder to serve the dashboard from: ``ui_dir`` when given, else the packaged build,
    else the checkout's. Warns when the folder has no build."""
    if ui_dir:
        folder = os.path.abspath(ui_dir)
    else:
        folder = next((f for f in (PACKAGED, CHECKOUT) if _built(f)), CHECKOUT)
    if not _built(folder):
        log.warning("server: no dashboard build in %s (index.html missing); the API works, / says how to "
                    "build it", folder)
    return folder


def _index(dist: str):
    resp = send_from_directory(dist, "index.html", max_age=0)
    resp.headers["Cache-Control"] = "no-cache"
    return resp


@bp.get("/")
@bp.get("/<path:path>")
def dashboard(path: str = ""):
    dist = current_app.extensions["zwdx"].settings.ui_dir
    if path.startswith("api/"):
        raise NotFound(f"no API route /{path}")
    inside = safe_join(dist, path) if path else None  # None: the path leaves the build
    path = os.path.relpath(inside, dist).replace(os.sep, "/") if inside else ""  # as the build names it
    if inside is not None and os.path.isfile(inside):
        immutable = path.startswith("assets/")
        resp = send_from_directory(dist, path, max_age=_YEAR if immutable else 0)
        if immutable:
            resp.headers["Cache-Control"] = f"public, max-age={_YEAR}, immutable"
        return resp
    if path.startswith("assets/"):
        raise NotFound(f"no dashboard file /{path}: rebuild the dashboard (cd ui && npm run build)")
    if _built(dist):
        return _index(dist)
    return _MISSING, 200, {"Content-Type": "text/html"}
