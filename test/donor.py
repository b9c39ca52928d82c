"""A GPU client and a dashboard spoken by the test itself, over the server's real wire: for the
tests of who may read and write what, which need placed jobs and their rank keys but no training.

    Donor(url, donor_token, client_id, slots=1)  registers CPU slots (``kind="cuda"``: GPUs) on
                                                 /gpu (keeping the client secret it is
                                                 answered), heartbeats, offers a
                                                 rendezvous port when asked, keeps each JobAssign
                                                 (``rank_key(job_id, rank)``); it starts no rank
    Rank(url, rank_key, job_id, rank=0)          what a rank process sends, with its rank key
                                                 only: its status, events, checkpoint files,
                                                 weights (``requests``)
    Dashboard(url, submitter_token)              a browser's /ui connection, keeping every event

The server is a real process (``procs.Server``); only the donor's side is played here, by the
messages of ``zwdx.protocol.gpu``, as ``gpu_client/agent/agent.py`` sends them.
"""
from __future__ import annotations

import hashlib
import threading

import requests
import socketio

from procs import free_port, wait_until
from zwdx import defaults
from zwdx.protocol import (EV_HEARTBEAT, EV_JOB_ASSIGN, EV_RANKS_EXITED, EV_REGISTER, EV_RESERVE_PORT, GPU_NAMESPACE,
                           UI_NAMESPACE, runtime_versions)
from zwdx.protocol.gpu import Heartbeat, JobAssign, PortOffer, RanksExited, Register, Running, Slot, SlotStats
from wire_auth import connect_auth

GiB = 1 << 30


class Donor(socketio.Client):
    """A GPU client with ``slots`` CPU slots (GPUs: ``kind="cuda"``) in the room of ``token`` (a
    donor token); it runs nothing. ``client_secret``: what its first register was answered with."""

    def __init__(self, url: str, token: str, client_id: str, slots: int = 1, kind: str = "cpu"):
        super().__init__(reconnection=False)
        self.client_id, self.slots = client_id, slots
        self.assigned: dict[str, JobAssign] = {}  # job id -> what the server assigned
        self._stopped = threading.Event()
        self.on(EV_RESERVE_PORT, lambda data: PortOffer(addr="127.0.0.1", port=free_port()).model_dump(),
                namespace=GPU_NAMESPACE)
        self.on(EV_JOB_ASSIGN, self._assign, namespace=GPU_NAMESPACE)
        self.connect(url, namespaces=[GPU_NAMESPACE], auth=connect_auth(token), transports=["websocket"],
                     wait_timeout=30)
        hello = Register(client_id=client_id, hostname=f"host-{client_id}", versions=runtime_versions(),
                         slots=[Slot(index=i, kind=kind, name=kind.upper(), memory_total=8 * GiB, memory_free=8 * GiB)
                                for i in range(slots)])
        answer = self.call(EV_REGISTER, hello.model_dump(mode="json"), namespace=GPU_NAMESPACE, timeout=30)
        assert answer["ok"], answer
        self.client_secret: str | None = answer.get("client_secret")
        self._beats = threading.Thread(target=self._beat, name=f"donor-{client_id}", daemon=True)
        self._beats.start()

    def _assign(self, data) -> None:
        assign = JobAssign.model_validate(data)
        self.assigned[assign.job_id] = assign

    def _beat(self) -> None:
        while not self._stopped.wait(1.0):
            beat = Heartbeat(slots=[SlotStats(index=i, memory_free=8 * GiB) for i in range(self.slots)],
                             running=[Running(job_id=a.job_id, attempt=a.attempt) for a in self.assigned.values()])
            try:
                self.emit(EV_HEARTBEAT, beat.model_dump(mode="json"), namespace=GPU_NAMESPACE)
            except socketio.exceptions.SocketIOError:
                return

    def rank_key(self, job_id: str, rank: int = 0, timeout: float = 30) -> str:
        """The key the server gave this donor for the job's rank (waiting for its assignment)."""
        def key() -> str | None:
            assign = self.assigned.get(job_id)
            return next((r.key for r in assign.ranks if r.rank == rank), None) if assign else None
        return wait_until(key, timeout, what=f"rank {rank} of job {job_id} assigned to {self.client_id}")

    def exited(self, job_id: str) -> None:
        """Say the job's ranks here are gone (as the GPU client does once its processes exited)."""
        assign = self.assigned.pop(job_id)
        exits = RanksExited(job_id=job_id, attempt=assign.attempt, exits={str(r.rank): 0 for r in assign.ranks})
        answer = self.call(EV_RANKS_EXITED, exits.model_dump(mode="json"), namespace=GPU_NAMESPACE, timeout=30)
        assert answer["ok"], answer

    def stop(self) -> None:
        self._stopped.set()
        self.disconnect()


class Rank:
    """The REST calls of rank ``rank`` of a job, with a rank key (which may be another's) and, to
    see that it opens nothing here, a room token (``token``)."""

    def __init__(self, url: str, rank_key: str | None, job_id: str, rank: int = 0, token: str | None = None):
        self.base = f"{url}{defaults.API_PREFIX}/jobs/{job_id}"
        self.rank = rank
        self.headers = {**({defaults.RANK_KEY_HEADER: rank_key} if rank_key else {}),
                        **({defaults.TOKEN_HEADER: token} if token else {})}

    def _call(self, method: str, path: str, **kwargs) -> requests.Response:
        return requests.request(method, f"{self.base}{path}", headers={**self.headers, **kwargs.pop("headers", {})},
                                timeout=30, **kwargs)

    def status(self, status: str, **fields) -> requests.Response:
        return self._call("POST", f"/ranks/{self.rank}", json={"status": status, **fields})

    def events(self, *events: tuple[str, dict], step: int = 0) -> requests.Response:
        """Post events, each ``(kind, data)``: ``("metric", {"loss": 0.5})``, ``("log", {"text": ...})``."""
        return self._call("POST", "/events", json={"events": [
            {"kind": kind, "rank": self.rank, "key": f"{step}:{i}", "step": step, "data": data}
            for i, (kind, data) in enumerate(events)]})

    def put(self, path: str, data: bytes) -> requests.Response:
        return self._call("PUT", path, data=data, headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})

    def commit(self, n: int, files: list[str], epoch: int = 0, step: int = 0) -> requests.Response:
        return self._call("POST", f"/checkpoints/{n}/commit",
                          json={"files": files, "epoch": epoch, "step": step, "format": "torch"})

    def bundle(self) -> requests.Response:
        return self._call("GET", "/bundle")


class Dashboard(socketio.Client):
    """A dashboard's /ui connection to the room of ``token`` (a submitter token); ``received``:
    (event, payload) in order."""

    def __init__(self, url: str, token: str):
        super().__init__(reconnection=False)
        self.received: list[tuple[str, object]] = []
        self.on("*", lambda event, *args: self.received.append((event, args[0] if args else None)),
                namespace=UI_NAMESPACE)
        self.connect(url, namespaces=[UI_NAMESPACE], auth=connect_auth(token), transports=["websocket"],
                     wait_timeout=30)

    def saw(self, event: str, predicate=lambda payload: True) -> bool:
        return any(name == event and predicate(payload) for name, payload in list(self.received))
