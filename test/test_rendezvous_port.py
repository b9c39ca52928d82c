"""A job's rendezvous port is held from the moment rank 0's GPU client offers it until rank 0's
store serves on that very socket: no port is bound, closed and bound again, so nothing else on
the machine (another job's rank, an outgoing connection, a bystander) can take it in between
(issue 30: ``zwdx run`` with two ranks on one GPU client failed with EADDRINUSE about half the
time when the port was picked by binding port 0 and closing it)."""
from __future__ import annotations

import datetime
import errno
import os
import shutil
import socket
import subprocess
import sys
import threading
import types

import pytest

from gpu_client.agent.agent import Agent
from gpu_client.sandbox.isolation import ProcessIsolation
from procs import ROOT


def offering_agent(addr: str = "127.0.0.1") -> Agent:
    """An agent as far as offering ports goes (no server, no slots)."""
    agent = Agent.__new__(Agent)
    agent.advertise_addr = addr
    agent.identity = types.SimpleNamespace(client_id="gpu-test")
    agent.listeners, agent._listeners_lock = {}, threading.Lock()
    return agent


def bind(port: int) -> int:
    """0 if ``port`` on 127.0.0.1 could be bound now, else the errno."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return 0
        except OSError as exc:
            return exc.errno


def test_an_offered_rendezvous_port_is_held_until_its_rank_takes_it():
    agent = offering_agent()
    port = agent._on_reserve_port({"job_id": "j1"})["port"]
    assert bind(port) == errno.EADDRINUSE  # nobody else can take it while the job is being placed
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # and it listens: a rank that connects early waits in its backlog
    held = agent._held_listener(types.SimpleNamespace(job_id="j1", master_port=port))
    assert held is not None and held.getsockname()[1] == port and agent.listeners == {}
    held.close()


def test_an_offer_for_another_attempt_or_a_placement_elsewhere_lets_the_old_port_go():
    agent = offering_agent()
    first = agent._on_reserve_port({"job_id": "j1"})["port"]
    second = agent._on_reserve_port({"job_id": "j1"})["port"]  # placed again: a new offer
    assert first != second and bind(first) == 0 and bind(second) == errno.EADDRINUSE
    # an assignment naming another port than the one held (offered for another placement): nothing handed
    assert agent._held_listener(types.SimpleNamespace(job_id="j1", master_port=first)) is None
    assert bind(second) == 0


CHILD = """
import datetime, sys
from gpu_client.rank.rendezvous import take_listeners, tcp_store
sys.stdin.readline()
take_listeners(1)
store = tcp_store("127.0.0.1", int(sys.argv[1]), 2, True, wait_for_workers=False,
                  timeout=datetime.timedelta(seconds=30))
store.set("served-by", str(__import__("os").getpid()))
store.wait(["done"])
"""


def test_a_rank_process_serves_its_store_on_the_socket_handed_over(tmp_path):
    """The launcher's way: the rank process's channel (``ProcessIsolation.popen``) carries the
    listening socket; its TCPStore serves on it, and a client of the port reaches that store."""
    import torch.distributed as dist
    agent = offering_agent()
    port = agent._on_reserve_port({"job_id": "j1"})["port"]
    held = agent._held_listener(types.SimpleNamespace(job_id="j1", master_port=port))
    iso = ProcessIsolation(str(tmp_path / "ranks"), str(tmp_path / "work"))
    os.makedirs(iso.rank_dir, exist_ok=True)
    proc = iso.popen([sys.executable, "-c", CHILD, str(port)], None, {**os.environ, "PYTHONPATH": ROOT})
    try:
        proc.stdin.write(b"spec\n")
        proc.stdin.flush()
        socket.send_fds(proc.channel, [b"L"], [held.fileno()])
        proc.channel.close()
        held.close()  # the agent's copy: the port stays bound by the rank's
        assert bind(port) == errno.EADDRINUSE
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        assert client.get("served-by").decode() == str(proc.pid)
        client.set("done", "1")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_two_ranks_of_a_script_job_on_one_gpu_client_meet_every_time(tmp_path):
    """``zwdx run --nproc 2`` on one GPU client of two CPU slots, several times in a row: every
    run completes (rank 0's store serves on the held port; the script's ranks are its clients,
    as under torchrun's agent store)."""
    from procs import GpuClient, Server, wait_until, SLACK
    from zwdx import ZWDX
    from zwdx.testing import child_env
    server = Server(str(tmp_path / "server"))
    clients = []
    try:
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("two-on-one")
        token = tmp_path / "token"
        token.write_text(room["submitter_token"] + "\n")
        os.chmod(token, 0o600)
        clients.append(GpuClient(server.url, room["donor_token"], str(tmp_path / "a"), client_id="client-a",
                                 extra=["--cpu-slots", "2"]))
        sdk.room_token = room["submitter_token"]
        wait_until(lambda: sum(len(c["slots"]) for c in sdk.get_room()["clients"] if c["status"] == "online") == 2,
                   30 + SLACK, what=f"two slots online\n{clients[0].tail()}")
        env = child_env({"PYTHONPATH": ROOT, "ZWDX_CONFIG_DIR": str(tmp_path / "config")})
        wd = tmp_path / "wd"  # zwdx run brings the outputs back into its working dir
        wd.mkdir()
        shutil.copy(os.path.join(ROOT, "test", "scripts", "ddp.py"), wd / "ddp.py")
        runs = int(os.environ.get("ZWDX_TEST_RENDEZVOUS_RUNS", "5"))
        for n in range(runs):
            done = subprocess.run([sys.executable, "-m", "zwdx.cli", "run", "--server", server.url, "--room-token-file",
                                   str(token), "--nproc", "2", "ddp.py"], cwd=wd,
                                  env=env, capture_output=True, text=True, timeout=240 + SLACK)
            assert done.returncode == 0, f"run {n + 1} of {runs}:\n{done.stdout}\n{done.stderr}"
    finally:
        for client in clients:
            client.stop()
        server.stop()
