"""DILOCO where the GPU clients cannot reach each other, only the server: each in its own network
namespace (test_netns.py's bridge), with a route that refuses the other client's address. DDP
trains the example model first, while they still reach each other; then, cut off from each
other, DILOCO trains it on the same samples and comes within 5% of DDP's loss."""
from __future__ import annotations

import errno
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import zwdx
import mnist
import test_netns
from test_netns import sh

pytestmark = pytest.mark.slow  # a server and GPU clients in network namespaces

net_hosts, net_cluster = test_netns.net_hosts, test_netns.net_cluster  # the fixtures, not the tests

EPOCHS = 6


def cut_off(net, a: str, b: str) -> None:
    """``a`` and ``b`` no longer reach each other (each refuses the other's address); both still
    reach the server."""
    for one, other in ((a, b), (b, a)):
        sh("ip", "netns", "exec", net.hosts[one][0], "ip", "route", "add", "unreachable", f"{net.hosts[other][1]}/32")


def connect_error(net, source: str, addr: str, port: int) -> int:
    """The errno of a TCP connection from ``source``'s namespace to ``addr``:``port`` (0: it connected)."""
    code = (f"import socket\ntry:\n socket.create_connection(({addr!r}, {port}), 3).close(); print(0)\n"
            f"except OSError as e:\n print(e.errno)")
    out = subprocess.run(["ip", "netns", "exec", net.hosts[source][0], sys.executable, "-c", code],
                         capture_output=True, text=True, check=True)
    return int(out.stdout.strip())


def train_loss(model) -> float:
    x, y = mnist.load_dataset(train=True).tensors
    model.eval()
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def submit(sdk, parallelism: str, **kwargs) -> dict:
    torch.manual_seed(0)  # the same first weights for both
    model = mnist.Net()
    return sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=mnist.train,
                          eval_func=mnist.test, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
                          parallelism=parallelism, resources=zwdx.Resources(world_size=2),
                          training=zwdx.Training(epochs=EPOCHS), run=zwdx.Run(progress=False, timeout=600), **kwargs)


@pytest.mark.parametrize("net_hosts", [["s", "a", "b"]], indirect=True)
def test_diloco_trains_between_gpu_clients_that_reach_only_the_server(net_cluster):
    net, sdk, url = net_cluster
    server_port = int(url.rsplit(":", 1)[1])
    ddp = submit(sdk, "DDP")
    assert ddp["status"] == "completed"
    ddp_loss = train_loss(sdk.get_trained_model(ddp["job_id"], mnist.Net()))

    cut_off(net, "a", "b")
    assert connect_error(net, "a", net.hosts["b"][1], 9) == errno.EHOSTUNREACH
    assert connect_error(net, "b", net.hosts["a"][1], 9) == errno.EHOSTUNREACH
    assert connect_error(net, "a", net.hosts["s"][1], server_port) == 0

    diloco = submit(sdk, "DILOCO", strategy=zwdx.Diloco(inner_steps=12))
    assert diloco["status"] == "completed", diloco["reason"]
    diloco_loss = train_loss(sdk.get_trained_model(diloco["job_id"], mnist.Net()))
    print(f"\ntraining loss after {EPOCHS} epochs on 2 workers: DDP {ddp_loss:.4f}, DILOCO {diloco_loss:.4f} "
          f"({diloco_loss / ddp_loss:.2f} x)")
    assert diloco_loss <= 1.05 * ddp_loss

    logs = [line["text"] for line in sdk.get_job_logs(diloco["job_id"])]
    assert any(t.startswith("DILOCO: the workers do not all reach each other") for t in logs), logs  # tried, then not
    rounds = [line for line in logs if line.startswith("diloco round") and "through the server" in line]
    assert len(rounds) == EPOCHS * 24 // 12 + 1, logs  # 24 steps an epoch per worker; the last round: nothing to add
    assert all("rank(s) 0, 1 through the server" in line for line in rounds[:-1])
    sent = sdk.get_job_metrics(diloco["job_id"])["sent_bytes"]
    assert {p["rank"] for p in sent} == {0, 1} and len(sent) == 2 * len(rounds)
