"""The zwdx server: a Flask app (REST API under /api/v1, the dashboard) plus Flask-SocketIO
(GPU clients on /gpu, browsers on /ui).

    create_app(config) -> app          # app.extensions["zwdx"] is the ServerContext
    socketio.run(app, ...)             # what `zwdx server` does
"""
from __future__ import annotations

import logging
import os
import threading

from flask import Flask
from flask_socketio import SocketIO

from .. import defaults

log = logging.getLogger(__name__)

socketio = SocketIO()


class ServerContext:
    """What every part of the server shares: config, store, artifact bytes, scheduler."""

    def __init__(self, app: Flask):
        from .artifacts import FileArtifactStore
        from .store import open_store
        cfg = app.config
        self.config = cfg
        self.store = open_store(cfg["DATA_DIR"], cfg.get("MONGO_URI"))
        if cfg.get("MONGO_URI"):
            from .store.gridfs import GridFSArtifactStore
            self.artifacts = GridFSArtifactStore(cfg["MONGO_URI"])
        else:
            self.artifacts = FileArtifactStore(os.path.join(cfg["DATA_DIR"], "artifacts"))
        from .scheduler import Scheduler
        self.scheduler = Scheduler(self)
        self.stopping = threading.Event()


def create_app(config: dict | None = None) -> Flask:
    app = Flask(__name__, static_folder=None)
    app.config.from_mapping(
        DATA_DIR=os.path.abspath("zwdx-data"),
        MONGO_URI=None,
        MAX_ARTIFACT_BYTES=defaults.MAX_ARTIFACT_BYTES,
        CLIENT_TIMEOUT=defaults.CLIENT_TIMEOUT,
        HEARTBEAT_INTERVAL=defaults.HEARTBEAT_INTERVAL,
        COLLECTIVE_TIMEOUT=defaults.COLLECTIVE_TIMEOUT,
        UI_DIST=os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
            os.path.abspath(__file__)))), "ui", "dist"),
    )
    app.config.from_prefixed_env("ZWDX")
    if config:
        app.config.update(config)
    app.config["MAX_CONTENT_LENGTH"] = None  # artifacts stream; their own limit applies

    ctx = ServerContext(app)
    app.extensions["zwdx"] = ctx

    from . import api, checkpoints, dashboard_api, events, ui
    app.register_blueprint(api.bp)
    app.register_blueprint(checkpoints.bp)
    app.register_blueprint(dashboard_api.bp)
    app.register_blueprint(ui.bp)
    api.register_error_handlers(app)
    socketio.init_app(app, async_mode="threading", max_http_buffer_size=1024 * 1024)
    events.register(socketio)
    ctx.scheduler.start(app)
    log.info("server: store %s, data dir %s", type(ctx.store).__name__, app.config["DATA_DIR"])
    return app
