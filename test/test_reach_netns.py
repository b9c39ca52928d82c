"""DDP between GPU clients that cannot reach each other (each in its own network namespace,
reaching only the server: test_diloco_netns.py's ``cut_off``): the job fails within seconds,
not at the collective timeout, naming the pair and suggesting DILOCO; the server remembers
the pair, and the next DDP job waits saying so instead of being placed on it. Each GPU client
registered its link to the server, which ``zwdx room clients --json`` shows."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import zwdx
import mnist
import test_netns
from procs import wait_until
from test_diloco_netns import cut_off

pytestmark = pytest.mark.slow  # a server and GPU clients in network namespaces

net_hosts, net_cluster = test_netns.net_hosts, test_netns.net_cluster  # the fixtures, not the tests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: The collective timeout the DDP jobs here are given: what a failure would wait for without the probe.
COLLECTIVE_TIMEOUT = 300


def room_clients(sdk, url: str) -> dict[str, dict]:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ZWDX_")}, "PYTHONPATH": ROOT,
           "ZWDX_ROOM_TOKEN": sdk.room_token, "ZWDX_REMEMBER": "0"}
    out = subprocess.run([sys.executable, "-m", "zwdx.cli", "room", "clients", "--json", "--server", url], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return {c["id"]: c for c in json.loads(out)}


def submit(sdk, wait: bool = True, **run):
    model = mnist.Net()
    return sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=mnist.train,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="DDP",
                          resources=zwdx.Resources(world_size=2),
                          training=zwdx.Training(epochs=1, collective_timeout=COLLECTIVE_TIMEOUT),
                          run=zwdx.Run(progress=False, **run), wait=wait)


@pytest.mark.parametrize("net_hosts", [["s", "a", "b"]], indirect=True)
def test_ddp_between_clients_that_cannot_reach_each_other_fails_at_once_naming_them(net_cluster):
    net, sdk, url = net_cluster
    clients = room_clients(sdk, url)
    for name in ("a", "b"):
        link = clients[name]["link"]
        assert link["rtt"] > 0 and link["up"] > 0 and link["down"] > 0, clients[name]
        assert clients[name]["advertise_addr"] == net.hosts[name][1] and clients[name]["reach_port"]

    cut_off(net, "a", "b")
    started = time.time()
    result = submit(sdk, timeout=COLLECTIVE_TIMEOUT, raise_on_failure=False)
    took = time.time() - started
    print(f"\nDDP between GPU clients that cannot reach each other: failed after {took:.1f} s "
          f"(collective timeout {COLLECTIVE_TIMEOUT} s): {result['reason']}")
    assert result["status"] == "failed"
    reason = result["reason"]
    assert "gpu clients a (host" in reason or "gpu clients b (host" in reason, reason
    assert "cannot reach each other" in reason and ("a -> b" in reason or "b -> a" in reason), reason
    assert 'parallelism="DILOCO"' in reason, reason
    assert took < COLLECTIVE_TIMEOUT / 5, took  # seconds, not the collective timeout

    clients = room_clients(sdk, url)
    assert clients["a"]["unreachable"] == ["b"] and clients["b"]["unreachable"] == ["a"]
    waiting = submit(sdk, wait=False)
    reason = wait_until(lambda: "cannot reach each other" in (r := sdk.get_job(waiting).get("waiting_reason") or "")
                        and r, 60, what="the next DDP job waiting, kept off the pair")
    assert "DILOCO" in reason and sdk.get_job(waiting)["status"] == "queued"
    sdk.cancel_job(waiting)
