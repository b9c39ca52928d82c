"""Stop the server (SIGTERM, then SIGKILL) and start another on the same store: rooms,
tokens, job history, metrics and artifacts are all there, and queued jobs are still queued.
Run on the embedded store (the same data dir) and on MongoDB (the same database, with a
new, empty data dir each time: nothing may live on the server's disk)."""
from __future__ import annotations

import hashlib
import signal

import pytest
import requests
import torch

import mnist
from mnist import Net, create_loader, train
from procs import SLACK, GpuClient, Server, wait_until
from store_backends import *  # noqa: F401,F403  (fixtures: backend, mongo_uri, ...)
import zwdx
from zwdx import ZWDX, defaults
from zwdx.server.store import SCHEMA_VERSION

pytestmark = pytest.mark.slow  # servers killed and started again, GPU clients, a job


def start_server(backend, tmp_path, n: int) -> Server:
    if backend.name == "sqlite":
        return Server(backend.where)
    return Server(str(tmp_path / f"server-{n}"), extra=["--mongo-uri", backend.where])


def weights(server: Server, job_id: str, token: str) -> tuple[str, str]:
    """sha256 of the weights as downloaded, and the one the server announces."""
    resp = requests.get(f"{server.url}{defaults.API_PREFIX}/jobs/{job_id}/weights",
                        headers={defaults.TOKEN_HEADER: token}, timeout=30)
    resp.raise_for_status()
    return hashlib.sha256(resp.content).hexdigest(), resp.headers[defaults.SHA256_HEADER]


def what_a_user_sees(server: Server, token: str, done: str, queued: str) -> dict:
    sdk = ZWDX(server.url, room_token=token)
    room = sdk.get_room()
    jobs = {j["id"]: j for j in sdk.list_jobs()}
    job = sdk.get_job(done)
    waiting = sdk.get_job(queued)
    return {
        "room": (room["id"], room["name"]),
        "jobs": [(j["id"], j["status"]) for j in jobs.values()],
        "done": (job["status"], job["final_loss"], job["results"], job["world_size"],
                 [t["status"] for t in job["timeline"]], job["weights_artifact"]),
        "metrics": sdk.get_job_metrics(done),
        "logs": sdk.get_job_logs(done),
        "weights": weights(server, done, token),
        "queued": (waiting["status"], waiting["queue_position"], waiting["spec"]["resources"]["world_size"]),
    }


def test_everything_survives_sigterm_and_sigkill_of_the_server(backend, tmp_path):
    server = start_server(backend, tmp_path, 1)
    clients = []
    try:
        sdk = ZWDX(server.url)
        made = sdk.create_room("durable")
        token = made["token"]
        for name in ("a", "b"):
            clients.append(GpuClient(server.url, made["donor_token"], str(tmp_path / name), client_id=f"durable-{name}"))
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room(token)["clients"]) == 2, 60,
                   what="two gpu clients online")
        result = sdk.submit_job(Net(), create_loader, train, eval_func=mnist.test,
                                optimizer=torch.optim.AdamW(Net().parameters(), lr=3e-3),
                                resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=1),
                                run=zwdx.Run(room_token=token, progress=False, timeout=180))
        assert result["status"] == "completed"
        done = result["job_id"]
        for client in clients:
            client.stop()
        queued = sdk.submit_job(Net(), create_loader, train, resources=zwdx.Resources(world_size=3),
                                run=zwdx.Run(room_token=token, progress=False), wait=False)
        before = what_a_user_sees(server, token, done, queued)
        assert before["queued"] == ("queued", 1, 3)
        assert before["metrics"]["loss"] and before["metrics"]["accuracy"]
        assert before["weights"][0] == before["weights"][1]
        trained = sdk.get_trained_model(done, Net(), token).state_dict()

        outcomes = {}
        for n, sig in ((2, signal.SIGTERM), (3, signal.SIGKILL)):
            server.kill(sig)
            server.popen.wait(30)
            server.stop()
            server = start_server(backend, tmp_path, n)
            after = what_a_user_sees(server, token, done, queued)
            for key in before:
                assert after[key] == before[key], f"after {sig.name}, {key} differs"
            again = ZWDX(server.url).get_trained_model(done, Net(), token).state_dict()
            assert all(torch.equal(again[k], trained[k]) for k in trained)
            outcomes[sig.name] = "all there, queued job still queued"
        later = ZWDX(server.url).submit_job(Net(), create_loader, train, resources=zwdx.Resources(world_size=3),
                                            run=zwdx.Run(room_token=token, progress=False),
                                            wait=False)
        assert ZWDX(server.url).get_job(later, token)["queue_position"] == 2  # behind the one queued before
        print(f"\ndurability [{backend.name}]: " + "; ".join(f"{k}: {v}" for k, v in outcomes.items()))
    finally:
        for client in clients:
            client.stop()
        server.stop()


def test_a_server_refuses_a_store_from_a_newer_zwdx(backend, tmp_path):
    backend.open().close()
    backend.set_schema_version(SCHEMA_VERSION + 1)
    with pytest.raises(RuntimeError) as err:
        start_server(backend, tmp_path, 1).stop()
    assert f"schema version {SCHEMA_VERSION + 1}, newer than this zwdx understands" in str(err.value)


def test_a_serving_sqlite_store_copies_its_log_into_the_file_from_a_thread_of_its_own(tmp_path):
    """``zwdx server`` checkpoints SQLite's write-ahead log from an OS thread (a commit that did
    it would hold every connection of a gevent server still for its fsync): after a pause, what
    was written is in the database file itself, though far less than the 1,000 pages at which a
    commit would have copied it."""
    import os
    import sqlite3

    from zwdx.server.store.sqlite import SQLiteStore
    from zwdx.server.store.sqlite_db import CHECKPOINT_INTERVAL
    path = str(tmp_path / "zwdx.sqlite3")

    def copied() -> bool:  # the file holds every page the database has (its log's included)
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            pages, size = conn.execute("PRAGMA page_count").fetchone()[0], conn.execute("PRAGMA page_size").fetchone()[0]
        finally:
            conn.close()
        return os.path.getsize(path) >= pages * size

    store = SQLiteStore(path)
    try:
        store.serving()
        wait_until(copied, CHECKPOINT_INTERVAL + SLACK, 0.05, what="what creating the store wrote copied")
        before = os.path.getsize(path)
        for i in range(200):
            store.create_room({"id": f"r{i}", "name": f"room {i:03d} " + "x" * 500, "created_at": 1.0})
        assert os.path.getsize(path) == before and not copied(), "a commit copied the log"
        wait_until(copied, CHECKPOINT_INTERVAL + SLACK, 0.05, what="the rooms' pages copied by the checkpointer")
        assert os.path.getsize(path) > before + 50_000
        assert store.get_room("r199")["name"].startswith("room 199")
    finally:
        store.close()


def test_a_server_process_freezes_what_survives_a_full_collection(tmp_path):
    """``zwdx server`` keeps full garbage collections short (zwdx/server/collector.py): what
    survived one is frozen within a second, so the next walks only what is newer. Run in a
    process of its own: freezing is process-wide."""
    import subprocess
    import sys
    script = (
        "import gc, threading, time\n"
        "from zwdx.server import collector\n"
        "collector.keep_pauses_short(threading.Event())\n"
        "frozen = gc.get_freeze_count()\n"
        "kept = [[i] for i in range(50000)]\n"  # long-lived, as a server's connections are
        "gc.collect()\n"
        "deadline = time.monotonic() + 10\n"  # within a second; more on a loaded machine
        "while gc.get_freeze_count() < frozen + 50000 and time.monotonic() < deadline:\n"
        "    time.sleep(0.05)\n"
        "print(frozen, gc.get_freeze_count())\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    before, after = map(int, out.stdout.split())
    assert after >= before + 50000, out.stdout
