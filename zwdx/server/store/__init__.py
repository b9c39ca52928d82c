from .base import SCHEMA_VERSION, Store
from .sqlite import SQLiteStore

__all__ = ["Store", "SQLiteStore", "SCHEMA_VERSION", "open_store"]


def open_store(data_dir: str, mongo_uri: str | None = None) -> Store:
    """The MongoDB store when a URI is given, else the embedded SQLite file in ``data_dir``."""
    if mongo_uri:
        from .mongo import MongoStore
        return MongoStore(mongo_uri)
    import os
    return SQLiteStore(os.path.join(data_dir, "zwdx.sqlite3"))
