"""The scheduler never waits for a GPU client: a rank-0 GPU client that registers and then
never answers ``reserve_port`` holds up its own job only, until ``RESERVE_TIMEOUT``: then the
job is placed again, not on that client.
Real processes: a server, a GPU client; the silent one is a Socket.IO client in this test."""
from __future__ import annotations

import threading

import pytest
import socketio
import torch

import mnist
from procs import GpuClient, Server, wait_until
from workloads import a_few_steps
import zwdx
from zwdx import ZWDX
from zwdx.protocol import EV_HEARTBEAT, EV_REGISTER, EV_RESERVE_PORT, GPU_NAMESPACE, runtime_versions
from wire_auth import connect_auth

pytestmark = pytest.mark.slow  # a server and GPU-client processes


class SilentClient(socketio.Client):
    """Registers one CPU slot and heartbeats like a GPU client; hears ``reserve_port`` and never
    answers it (python-socketio would acknowledge an event even without a handler)."""

    def __init__(self, url: str, token: str, client_id: str):
        super().__init__(reconnection=False)
        self.asked = threading.Event()
        self.stopped = threading.Event()
        self.connect(url, namespaces=[GPU_NAMESPACE], auth=connect_auth(token), transports=["websocket"])
        answer = self.call(EV_REGISTER, {
            "client_id": client_id, "hostname": "silent", "versions": runtime_versions(), "running": [],
            "slots": [{"index": 0, "kind": "cpu", "name": "CPU", "memory_total": 8 << 30, "memory_free": 8 << 30}]},
            namespace=GPU_NAMESPACE, timeout=15)
        assert answer["ok"], answer
        self.beats = threading.Thread(target=self._beat, daemon=True)
        self.beats.start()

    def _handle_event(self, namespace, id, data):
        if data and data[0] == EV_RESERVE_PORT:
            self.asked.set()  # heard, and left unanswered
            return
        super()._handle_event(namespace, id, data)

    def _beat(self):
        while not self.stopped.wait(1.0):
            self.emit(EV_HEARTBEAT, {"slots": [{"index": 0, "memory_free": 8 << 30}], "running": []},
                      namespace=GPU_NAMESPACE)

    def stop(self):
        self.stopped.set()
        self.disconnect()


def submit(sdk: ZWDX, token: str, wait: bool = True, timeout: float | None = None):
    return sdk.submit_job(mnist.Net(), mnist.create_loader, a_few_steps, resources=zwdx.Resources(world_size=1),
                          run=zwdx.Run(room_token=token, progress=False, timeout=timeout),
                          optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=1e-3), wait=wait)


def test_a_gpu_client_that_never_answers_delays_no_other_rooms_job(tmp_path):
    server = Server(str(tmp_path / "server"), env={"ZWDX_RESERVE_TIMEOUT": "600"})
    silent, client = None, None
    try:
        sdk = ZWDX(server.url)
        quiet_room, busy_room = sdk.create_room("quiet"), sdk.create_room("busy")
        quiet, busy = quiet_room["token"], busy_room["token"]
        silent = SilentClient(server.url, quiet_room["donor_token"], "silent-0")
        stuck = submit(sdk, quiet, wait=False)
        assert silent.asked.wait(60), "the scheduler never asked the silent client for a port"
        assert sdk.get_job(stuck, quiet)["status"] == "starting"

        client = GpuClient(server.url, busy_room["donor_token"], str(tmp_path / "busy"), client_id="busy-0")
        result = submit(sdk, busy, timeout=240)  # a scheduler waiting on the silent client would wait 600 s
        assert result["status"] == "completed", result["reason"]
        job = sdk.get_job(stuck, quiet)
        assert job["status"] == "starting" and job["master"] is None  # still waiting for its own answer
    finally:
        for proc in (silent, client):
            if proc is not None:
                proc.stop()
        server.stop()


def test_no_answer_in_time_frees_the_slot_and_places_the_job_elsewhere(tmp_path):
    """The silent client holds no job (issue 29 M3): its placement is given up, its slot freed,
    and the job waits for another GPU client, saying which one it passes over."""
    server = Server(str(tmp_path / "server"), env={"ZWDX_RESERVE_TIMEOUT": "2"})
    silent = None
    try:
        sdk = ZWDX(server.url)
        room = sdk.create_room("quiet")
        token = room["token"]
        silent = SilentClient(server.url, room["donor_token"], "silent-0")
        job_id = submit(sdk, token, wait=False)
        assert silent.asked.wait(60), "the scheduler never asked the silent client for a port"
        wait_until(lambda: sdk.get_job(job_id, token)["status"] == "queued", 30, what="the placement given up")
        job = sdk.get_job(job_id, token)
        assert job["avoid"] == ["silent-0"], job
        assert "rank-0 gpu client silent-0 did not offer a rendezvous address: no answer within 2 s" in \
            job["timeline"][-1]["reason"], job["timeline"][-1]
        wait_until(lambda: sdk.get_room(token)["totals"]["slots_busy"] == 0, 30, what="the slot freed")
        wait_until(lambda: "held a placement of this job that did not start" in
                   (sdk.get_job(job_id, token)["waiting_reason"] or ""), 30, what="the reason it waits")
    finally:
        if silent is not None:
            silent.stop()
        server.stop()
