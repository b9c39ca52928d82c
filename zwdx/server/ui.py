"""Serves the dashboard's production build (ui/dist) on the server's own port."""
from __future__ import annotations

import os

from flask import Blueprint, current_app, send_from_directory

bp = Blueprint("ui", __name__)

_MISSING = """<!doctype html><title>zwdx</title><h1>zwdx server</h1>
<p>The dashboard is not built. Run <code>cd ui && npm ci && npm run build</code> (setup.sh does it).</p>
<p>The API is under <code>/api/v1</code>; <code>/health</code> tells whether the server is up.</p>"""


@bp.get("/")
@bp.get("/<path:path>")
def dashboard(path: str = ""):
    dist = current_app.config["UI_DIST"]
    if path.startswith("api/"):
        from ..errors import NotFound
        raise NotFound(f"no API route {path}")
    if path and os.path.isfile(os.path.join(dist, path)):
        return send_from_directory(dist, path)
    if os.path.isfile(os.path.join(dist, "index.html")):
        return send_from_directory(dist, "index.html")  # client-side routes
    return _MISSING, 200, {"Content-Type": "text/html"}
