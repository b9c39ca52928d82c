"""The Flask extensions of the server, made once at import and bound to an app in
``create_app`` (the Flask tutorial's and Flask-SocketIO-Chat's habit).

Every server module imports them from here, downward, never from ``zwdx.server`` itself: the
package's ``__init__`` is the factory that imports them all.

    socketio    Flask-SocketIO: GPU clients on /gpu, dashboards on /ui; ``emit`` reaches the
                clients of the app it was bound to (``socketio.init_app(app)``)
"""
from __future__ import annotations

from flask_socketio import SocketIO

socketio = SocketIO()
