"""The Flask extensions of the server, made once at import and bound to an app in
``create_app`` (the Flask tutorial's and Flask-SocketIO-Chat's habit).

Every server module imports them from here, downward, never from ``zwdx.server`` itself: the
package's ``__init__`` is the factory that imports them all.

    socketio    Flask-SocketIO: GPU clients on /gpu, dashboards on /ui; ``emit`` reaches the
                clients of the app it was bound to (``socketio.init_app(app)``)
    Encoded     JSON text a model wrote itself, emitted as is
"""
from __future__ import annotations

from flask_socketio import SocketIO

socketio = SocketIO()


class Encoded(str):
    """JSON text a model wrote itself (``model_dump_json``), to ``socketio.emit`` as it is:
    the server's Socket.IO encoder (``wire_dumps``) puts it into the packet unread. One
    encoding, in pydantic's Rust, of a dashboard's 1,000-client list, instead of a dict of it
    made and then encoded again. Not through a message queue, which carries it as JSON, a
    plain string at the other end: ``notify.wire`` sends a dict there."""
    __slots__ = ()
