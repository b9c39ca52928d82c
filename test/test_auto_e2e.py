"""parallelism="AUTO" end to end, in real processes: a server, two CPU GPU clients, the SDK. On one
host that reach each other the job runs as DDP; on two hosts whose links are below the server's
AUTO_MIN_LINK, as DILOCO. Either way the result, the record and the log say what AUTO chose and why."""
from __future__ import annotations

import pytest
import torch

import mnist
from procs import GpuClient, Server, wait_until


@pytest.fixture
def room_of(tmp_path):
    """room_of(server_env, hosts) -> (sdk, token): a server and two GPU clients (one CPU slot each,
    on the given host ids), both online; stopped after the test."""
    started = []

    def make(server_env: dict, hosts: tuple[str, str]):
        from zwdx import ZWDX
        server = Server(str(tmp_path / "server"), env=server_env)
        started.append(server)
        sdk = ZWDX(server.url, remember=False)
        room = sdk.create_room("auto")
        sdk.room_token = room["token"]
        for name, host in zip("ab", hosts):
            started.insert(0, GpuClient(server.url, room["donor_token"], str(tmp_path / name), client_id=f"client-{name}",
                                        env={"ZWDX_HOST_ID": host}))
        wait_until(lambda: sum(c["status"] == "online" for c in sdk.get_room()["clients"]) == 2, 60,
                   what="two gpu clients online")
        return sdk
    yield make
    for proc in started:
        proc.stop()


def submit(sdk):
    import zwdx
    torch.set_num_threads(1)
    model = mnist.Net()
    return sdk.submit_job(model, mnist.create_loader, mnist.train, mnist.test,
                          torch.optim.AdamW(model.parameters(), lr=3e-3), strategy=zwdx.Auto(),
                          resources=zwdx.Resources(world_size=2), training=zwdx.Training(epochs=1),
                          run=zwdx.Run(progress=False, timeout=300))


@pytest.mark.parametrize("setting, hosts, mode, why", [
    ({}, ("one", "one"), "DDP", "DDP: a replica needs"),
    ({"ZWDX_AUTO_MIN_LINK": "1e13"}, ("h1", "h2"), "DILOCO", "DILOCO: gpu client client-"),
])
def test_an_auto_job_runs_in_the_mode_the_room_calls_for(room_of, setting, hosts, mode, why):
    sdk = room_of(setting, hosts)
    result = submit(sdk)
    assert result.status == "completed", result.reason
    assert result.auto["parallelism"] == mode and result.auto["reason"].startswith(why), result.auto
    job = sdk.get_job(result.job_id)
    assert job["spec"]["parallelism"] == mode and sorted(p["client_id"] for p in job["placement"]) == \
        ["client-a", "client-b"]
    assert f"AUTO chose {result.auto['reason']}" in [line["text"] for line in sdk.get_job_logs(result.job_id)]
    assert result.results["accuracy"] > 0.3  # trained: chance is 0.1 (DILOCO: 1 epoch, fewer steps than inner_steps)
