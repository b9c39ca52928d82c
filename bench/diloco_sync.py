"""DILOCO's outer step through the server: who should average the pseudo-gradients?

    python bench/diloco_sync.py                                   # 2 and 4 workers, 25 M values, int8
    python bench/diloco_sync.py --workers 2,4,8 --numel 124000000 --rounds 3 --out bench/results/diloco-sync.md

Both ways run against a real server process on 127.0.0.1, with worker threads holding real rank
keys of a placed DILOCO job (a stand-in GPU client registers the slots and offers the port; it
starts no rank):

- **server**: each worker uploads its pseudo-gradient (``PUT .../diloco/rounds/<n>``) and polls
  for the average, which the server makes streaming (``zwdx.codec.average``) once all are in;
- **workers**: each worker uploads its pseudo-gradient as an artifact of the job (a checkpoint
  file, the route a worker-side scheme would use) and downloads every other worker's, then
  averages them itself.

Per round: the wall time (median), the bytes each worker sends and receives, and the CPU seconds
the server and the workers spent. From the bytes, the last columns project the time a round's
transfers take on a donor's link of 100 Mbit/s and 1 Gbit/s (each worker's own link; the server's
is assumed wider): what decides between the two on the internet.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import platform
import tempfile
import threading
import time
import uuid

import harness  # noqa: F401  (puts the checkout on sys.path)
import numpy as np
import requests
import socketio

from harness import ServerProc, cpu_seconds, fmt, free_port, machine, median, table, wait_until, write_out
from zwdx import codec, defaults
from zwdx.protocol import runtime_versions
from zwdx.protocol.base import PROTOCOL

P = defaults.API_PREFIX


class StandIn(socketio.Client):
    """A GPU client as far as the server can tell: ``slots`` CPU slots, a port when asked; keeps
    the rank keys of the job it is assigned and starts nothing."""

    def __init__(self, url: str, token: str, slots: int):
        super().__init__(reconnection=False)
        self.keys: dict[int, str] = {}
        self.on("reserve_port", lambda data: {"addr": "127.0.0.1", "port": free_port()}, namespace="/gpu")
        self.on("job_assign", self._assigned, namespace="/gpu")
        self.connect(url, namespaces=["/gpu"], auth={"token": token, "protocol": PROTOCOL}, transports=["websocket"])
        answer = self.call("register", {"client_id": f"bench-{uuid.uuid4().hex[:8]}", "hostname": "bench", "running": [],
                                        "versions": runtime_versions(),
                                        "slots": [{"index": i, "kind": "cpu", "memory_total": 1 << 34,
                                                   "memory_free": 1 << 34} for i in range(slots)]},
                           namespace="/gpu", timeout=15)
        assert answer["ok"], answer
        self._stop = threading.Event()
        threading.Thread(target=self._beat, args=(slots,), daemon=True).start()

    def _assigned(self, data):
        self.keys = {r["rank"]: r["key"] for r in data["ranks"]}

    def _beat(self, slots: int):
        while not self._stop.wait(1.0):
            try:
                self.emit("heartbeat", {"slots": [{"index": i, "memory_free": 1 << 34} for i in range(slots)],
                                        "running": []}, namespace="/gpu")
            except Exception:
                return

    def stop(self):
        self._stop.set()
        self.disconnect()


def placed_job(url: str, workers: int) -> tuple[str, str, dict[int, str], StandIn]:
    room = requests.post(f"{url}{P}/rooms", json={"name": "bench"}, timeout=10).json()
    headers = {defaults.TOKEN_HEADER: room["token"]}
    stand_in = StandIn(url, room["donor_token"], workers)
    bundle = requests.post(f"{url}{P}/artifacts", data=b"bundle", headers=headers, timeout=10).json()
    job = requests.post(f"{url}{P}/jobs", headers=headers, timeout=10, json={
        "bundle_artifact": bundle["id"], "versions": {"python": platform.python_version()}, "world_size": workers,
        "parallelism": "DILOCO"}).json()
    wait_until(lambda: len(stand_in.keys) == workers, 30, what="the job placed")
    return room["token"], job["id"], stand_in.keys, stand_in


def _put(session, url, data):
    resp = session.put(url, data=data, headers={defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()},
                       timeout=600)
    resp.raise_for_status()


def via_server(session, base: str, rank: int, n: int, data: bytes, workers: int) -> tuple[int, np.ndarray]:
    _put(session, f"{base}/diloco/rounds/{n}", data)
    while True:
        resp = session.get(f"{base}/diloco/rounds/{n}", timeout=600)
        if resp.status_code == 200:
            return len(resp.content), codec.decode(resp.content)
        time.sleep(0.02)


#: The workers' way: where each round's uploads went (round, rank) -> artifact id, and the room's
#: submitter token they went with. A rank key may put only its own checkpoint files, so the
#: uploads stand in as room artifacts: the same bytes through the same server.
_UPLOADED: dict[tuple[int, int], str] = {}
_ROOM: dict[str, str] = {}


def via_workers(session, base: str, rank: int, n: int, data: bytes, workers: int) -> tuple[int, np.ndarray]:
    url, headers = _ROOM["url"], {defaults.TOKEN_HEADER: _ROOM["token"]}
    resp = requests.post(f"{url}{P}/artifacts", data=data, timeout=600,
                         headers={**headers, defaults.SHA256_HEADER: hashlib.sha256(data).hexdigest()})
    resp.raise_for_status()
    _UPLOADED[(n, rank)] = resp.json()["id"]
    total, received = codec.decode(data), 0
    for other in (r for r in range(workers) if r != rank):
        while (n, other) not in _UPLOADED:
            time.sleep(0.02)
        resp = requests.get(f"{url}{P}/artifacts/{_UPLOADED[(n, other)]}", headers=headers, timeout=600)
        resp.raise_for_status()
        received += len(resp.content)
        total += codec.decode(resp.content)
    average = codec.decode(codec.encode(total / workers, "int8"))  # what the server would send: re-quantised
    return received, average


def run(url: str, server_pid: int, way, workers: int, numel: int, rounds: int, compression: str) -> dict:
    token, job_id, keys, stand_in = placed_job(url, workers)
    _ROOM.update(url=url, token=token)
    base = f"{url}{P}/jobs/{job_id}"
    rng = np.random.default_rng(0)
    payloads = {r: codec.encode(rng.standard_normal(numel).astype(np.float32) * 1e-3, compression)
                for r in range(workers)}
    times, received, cpu_server, cpu_workers = [], {}, [], []
    try:
        for n in range(rounds):
            results: dict[int, int] = {}

            def worker(rank: int):
                with requests.Session() as session:
                    session.headers[defaults.RANK_KEY_HEADER] = keys[rank]
                    results[rank] = way(session, base, rank, n, payloads[rank], workers)[0]
            threads = [threading.Thread(target=worker, args=(r,)) for r in range(workers)]
            server_before, workers_before, started = cpu_seconds(server_pid), time.process_time(), time.time()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            times.append(time.time() - started)
            cpu_server.append(cpu_seconds(server_pid) - server_before)
            cpu_workers.append((time.process_time() - workers_before) / workers)
            received = results
    finally:
        stand_in.stop()
        requests.post(f"{url}{P}/jobs/{job_id}/cancel", headers={defaults.TOKEN_HEADER: token}, timeout=10)
    sent = len(payloads[0])
    return {"way": way.__name__.replace("via_", ""), "workers": workers, "numel": numel, "compression": compression,
            "round_s": median(times), "sent": sent, "received": received[0], "server_cpu_s": median(cpu_server),
            "worker_cpu_s": median(cpu_workers)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--numel", type=int, default=25_000_000, help="values in the pseudo-gradient")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compression", default="int8", choices=codec.COMPRESSIONS)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rows, data = [], []
    with tempfile.TemporaryDirectory() as tmp:
        server = ServerProc(os.path.join(tmp, "server"), extra=["--room-max-artifact-bytes", "0"])
        try:
            for workers in (int(w) for w in args.workers.split(",")):
                for way in (via_server, via_workers):
                    r = run(server.url, server.pid, way, workers, args.numel, args.rounds, args.compression)
                    data.append(r)
                    moved = (r["sent"] + r["received"]) * 8
                    rows.append([r["way"], workers, fmt(r["round_s"], 2), fmt(r["sent"] / 1e6), fmt(r["received"] / 1e6),
                                 fmt(r["server_cpu_s"], 2), fmt(r["worker_cpu_s"], 2), fmt(moved / 100e6, 1),
                                 fmt(moved / 1e9, 1)])
                    print(rows[-1], flush=True)
        finally:
            server.stop()
    text = (f"\n### DILOCO sync: server averaging vs workers averaging ({args.numel / 1e6:g} M values, "
            f"{args.compression}, {args.rounds} rounds)\n\n{machine()}\n\n" + table(
                ["averaged by", "workers", "round s (loopback)", "MB sent / worker", "MB received / worker",
                 "server CPU s / round", "worker CPU s / round", "transfer s at 100 Mbit/s", "at 1 Gbit/s"], rows))
    print(text)
    write_out(args.out, text, {"runs": data, "machine": machine()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
