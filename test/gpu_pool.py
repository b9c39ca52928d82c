"""A server and GPU-client processes (one CPU slot each) in one room, for the tests of a module
whose jobs do not disturb each other: each process start imports torch, so a module starts
them once.

    pool = GpuPool(base_dir, clients=("a", "b"))    # healthy and online when returned
    pool.sdk, pool.token, pool.server, pool.clients
    pool.start("c")                                # one more GPU client, waited for until online
    pool.stop()                                    # every process it started, by pid

Its SDK remembers nothing (``remember=False``) and has the room's token as its default, so a
module-scoped pool never writes a credential store.
"""
from __future__ import annotations

import os

from procs import GpuClient, Server, wait_until
from zwdx import ZWDX


class GpuPool:
    def __init__(self, base: str, clients: tuple[str, ...] = ("a", "b"), server_extra: list[str] | None = None,
                 server_env: dict | None = None):
        self.base = base
        self.server = Server(os.path.join(base, "server"), extra=server_extra, env=server_env)
        self.clients: list[GpuClient] = []
        try:
            self.sdk = ZWDX(self.server.url, remember=False)
            made = self.sdk.create_room("pool")
            self.token, self.donor_token = made["token"], made["donor_token"]
            self.sdk.room_token = self.token
            self.start_all(clients)
        except BaseException:
            self.stop()
            raise

    def start(self, name: str, wait: bool = True, **kwargs) -> GpuClient:
        client = GpuClient(self.server.url, self.donor_token, os.path.join(self.base, name), client_id=f"client-{name}",
                           **kwargs)
        self.clients.append(client)
        if wait:
            wait_until(lambda: self.online(client), 60,
                       what=f"gpu client {name} online\n{client.tail() if not client.alive() else ''}")
        return client

    def start_all(self, names, **kwargs) -> list[GpuClient]:
        """``start`` each of ``names`` at once, then wait until all are online: a start is mostly
        the client's imports and registering, so several overlap."""
        started = [self.start(name, wait=False, **kwargs) for name in names]
        wait_until(lambda: all(self.online(c) for c in started), 60 + 15 * len(started),
                   what=f"gpu clients {list(names)} online")
        return started

    def online(self, client: GpuClient) -> bool:
        if not client.alive():
            raise RuntimeError(f"gpu client {client.client_id} exited:\n{client.tail()}")
        return any(c["id"] == client.client_id and c["status"] == "online" for c in self.sdk.get_room()["clients"])

    def idle(self) -> bool:
        """Every slot of the room free (the last job's rank processes gone)."""
        return all(s["job_id"] is None for c in self.sdk.get_room()["clients"] for s in c["slots"])

    def stop(self) -> None:
        GpuClient.stop_all(self.clients)  # told at once: their shutdowns overlap
        self.server.stop()
        if hasattr(self, "sdk"):
            self.sdk.close()
