"""Serves the dashboard's production build (ui/dist) on the server's own port.

Files under /assets carry a content hash in their names and are cached for a year; any other
path that is not a file is a client-side route and gets index.html (never cached, so a new
build shows up at the next load).
"""
from __future__ import annotations

import os

from flask import Blueprint, current_app, send_from_directory

from ..errors import NotFound

bp = Blueprint("ui", __name__)

_MISSING = """<!doctype html><title>zwdx</title><h1>zwdx server</h1>
<p>The dashboard is not built. Run <code>cd ui && npm ci && npm run build</code> (setup.sh does it).</p>
<p>The API is under <code>/api/v1</code>; <code>/health</code> tells whether the server is up.</p>"""

_YEAR = 365 * 24 * 3600


def _index(dist: str):
    resp = send_from_directory(dist, "index.html", max_age=0)
    resp.headers["Cache-Control"] = "no-cache"
    return resp


@bp.get("/")
@bp.get("/<path:path>")
def dashboard(path: str = ""):
    dist = current_app.config["UI_DIST"]
    if path.startswith("api/"):
        raise NotFound(f"no API route /{path}")
    if path and os.path.isfile(os.path.join(dist, path)):
        immutable = path.startswith("assets/")
        resp = send_from_directory(dist, path, max_age=_YEAR if immutable else 0)
        if immutable:
            resp.headers["Cache-Control"] = f"public, max-age={_YEAR}, immutable"
        return resp
    if path.startswith("assets/"):
        raise NotFound(f"no dashboard file /{path}: rebuild the dashboard (cd ui && npm run build)")
    if os.path.isfile(os.path.join(dist, "index.html")):
        return _index(dist)
    return _MISSING, 200, {"Content-Type": "text/html"}
