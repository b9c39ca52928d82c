"""Several server processes, one room (docs/deploy-scale.md), with real processes: two `zwdx
server`s on one MongoDB store (nx-27017, standing in for a replica set: one process, no
failover of its own) and one Redis message queue, HAProxy in front; two GPU clients and the SDK
reach the servers through the balancer only. The server that runs the scheduler is SIGKILLed
mid-job: the other one takes its lease over, the GPU clients reconnect through the balancer,
and the job completes with every metric once. Then Redis restarts, and the survivor places the
next job through it again.
"""
from __future__ import annotations

import re
import signal
import time

import pytest
import requests
import socketio
import torch

import mnist
import needs
from procs import SLACK, Server, wait_until
from workloads import slow_train
import zwdx
from zwdx import ZWDX, defaults
from zwdx.protocol import EV_JOB_UPDATE, UI_NAMESPACE
from zwdx.testing import BalancerProc, GpuClientProc, MongoProc, RedisProc
from wire_auth import connect_auth

pytestmark = pytest.mark.slow

#: Short, so that the take-over shows within seconds (the default is 6 s).
LEASE_TTL = 3.0


def leads(server: Server) -> bool:
    """Whether this server process says it runs the scheduler (its own /metrics, on loopback)."""
    try:
        text = requests.get(f"{server.url}/metrics", timeout=5).text
    except requests.RequestException:
        return False
    found = re.search(r"^zwdx_scheduler_leader (\S+)$", text, re.M)
    return bool(found) and float(found.group(1)) == 1.0


def subscribers(redis: RedisProc) -> int:
    """Server processes listening on Flask-SocketIO's channel."""
    import redis as redis_py
    client = redis_py.Redis.from_url(redis.url)
    try:
        return int(dict(client.pubsub_numsub("flask-socketio"))[b"flask-socketio"])
    finally:
        client.close()


class Dashboard(socketio.Client):
    """A dashboard's /ui connection over Socket.IO's long-polling (a browser's first transport):
    each poll is its own HTTP request, which must reach the server that holds the session."""

    def __init__(self, url: str, token: str):
        super().__init__(reconnection=False)
        self.updates: list[dict] = []
        self.on(EV_JOB_UPDATE, self.updates.append, namespace=UI_NAMESPACE)
        self.connect(url, namespaces=[UI_NAMESPACE], auth=connect_auth(token), transports=["polling"], wait_timeout=30)

    def saw(self, job_id: str, status: str) -> bool:
        return any(u["id"] == job_id and u["status"] == status for u in list(self.updates))


@pytest.fixture
def servers(tmp_path):
    needs.tool("redis-server", "apt-get install redis-server (./setup.sh --test installs it)")
    needs.tool("haproxy", "apt-get install haproxy (./setup.sh --test installs it)")
    needs.module("redis")
    needs.module("nx_27017")
    started = []
    try:
        mongo = MongoProc(str(tmp_path))
        started.append(mongo)
        redis = RedisProc(str(tmp_path))
        started.append(redis)
        env = {"ZWDX_MESSAGE_QUEUE": redis.url, "ZWDX_SCHEDULER_LEASE_TTL": str(LEASE_TTL)}

        def start(data_dir: str, port: int | None = None) -> Server:
            started.append(Server(data_dir, port=port, extra=["--mongo-uri", mongo.uri], env=env))
            return started[-1]
        servers = [start(str(tmp_path / name)) for name in ("s1", "s2")]
        balancer = BalancerProc(str(tmp_path), [s.url for s in servers])
        started.append(balancer)
        yield servers, balancer, redis, start
    finally:
        for proc in reversed(started):
            proc.stop()


def test_sigkill_the_scheduling_server_mid_job_the_other_takes_over(servers, tmp_path):
    (s1, s2), balancer, redis, start = servers
    wait_until(lambda: leads(s1) != leads(s2), LEASE_TTL + SLACK, what="one of the two servers leading")
    sdk = ZWDX(balancer.url)
    room = sdk.create_room("scale")
    clients = [GpuClientProc(balancer.url, room["donor_token"], str(tmp_path / name), f"client-{name}")
               for name in ("a", "b")]
    try:
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room(room["token"])["clients"]) == 2, 60,
                   what="both gpu clients online through the balancer")
        leader, other = (s1, s2) if leads(s1) else (s2, s1)
        watching = Dashboard(other.url, room["token"])  # the scheduler's moves reach it through Redis
        balanced = Dashboard(balancer.url, room["token"])  # its polls stay on one server (HAProxy's cookie)
        job_id = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=slow_train,
                                optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                                resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=2),
                                run=zwdx.Run(room_token=room["token"], progress=False), wait=False)
        wait_until(lambda: len(sdk.get_job_metrics(job_id).get("loss", [])) > 10, 120, what="training under way")
        assert leads(leader) and not leads(other)
        wait_until(lambda: watching.saw(job_id, "starting") and watching.saw(job_id, "running") and
                   balanced.saw(job_id, "running"), 30, what="both dashboards told the job was placed and runs")
        balanced.disconnect()
        on_leader = set(re.findall(r"gpu-client (\S+): registered", leader.output()))
        assert on_leader, "the balancer (leastconn) put no gpu client on the leading server"
        leader.kill(signal.SIGKILL)
        killed_at = time.time()
        leader.popen.wait()
        wait_until(lambda: leads(other), LEASE_TTL + 2 + SLACK, what="the other server taking the scheduler over")
        took_over = time.time() - killed_at

        result = sdk.wait(job_id, progress=False, timeout=300)
        assert result["status"] == "completed", result["reason"]
        wait_until(lambda: watching.saw(job_id, "completed"), 30, what="the dashboard on the survivor told")
        assert sdk.get_job(job_id).get("restarts", 0) == 0  # the ranks rode through; nothing restarted
        series = sdk.get_job_metrics(job_id)["loss"]
        for rank in (0, 1):
            steps = [p["step"] for p in series if p["rank"] == rank]
            assert steps == list(range(2 * 24)), f"rank {rank}: gaps or duplicates in {steps}"
        room_now = sdk.get_room(room["token"])
        assert all(c["status"] == "online" for c in room_now["clients"])  # on the survivor now
        back = max(c["connected_at"] for c in room_now["clients"] if c["id"] in on_leader)
        assert back > killed_at  # those of the killed server reconnected (to the survivor)
        print(f"\nscheduler's server SIGKILL -> lease taken over {took_over:.2f} s, gpu clients back "
              f"{back - killed_at:.2f} s (lease ttl {LEASE_TTL:g} s, client timeout {defaults.CLIENT_TIMEOUT:g} s)")

        # Redis restarts (it keeps nothing): the survivor subscribes again, and places new work on
        # the clients that reconnected to it through the queue, telling the dashboard
        redis.stop()
        redis = RedisProc(str(tmp_path), port=redis.port)
        wait_until(lambda: subscribers(redis) == 1, 30, what="the surviving server subscribed to Redis again")
        again = sdk.submit_job(model=mnist.Net(), data_loader_func=mnist.create_loader, train_func=slow_train,
                               optimizer=torch.optim.AdamW(mnist.Net().parameters(), lr=3e-3),
                               resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=1),
                               run=zwdx.Run(room_token=room["token"], progress=False, timeout=300), wait=True)
        assert again["status"] == "completed", again.get("reason")
        wait_until(lambda: watching.saw(again["job_id"], "completed"), 30, what="the dashboard told after Redis restarted")
        watching.disconnect()

        # the killed server, started again, joins as it is (no lease, every GPU client still
        # online); a donor token revoked through it closes the connections the survivor holds
        restarted = start(leader.data_dir, leader.port)
        time.sleep(LEASE_TTL)  # a few tries for the lease, each refused: it must not take it (no event to wait on)
        assert leads(other) and not leads(restarted)
        assert all(c["status"] == "online" for c in sdk.get_room(room["token"])["clients"])
        through = ZWDX(restarted.url, room_token=room["token"])
        donor = next(t for t in through.tokens.list() if t["role"] == "donor")
        through.tokens.revoke(donor["id"])
        wait_until(lambda: all(c["status"] == "offline" for c in sdk.get_room(room["token"])["clients"]),
                   LEASE_TTL + SLACK, what="the survivor closing the connections of the revoked donor token")
    finally:
        for client in clients:
            client.stop()
        redis.stop()
