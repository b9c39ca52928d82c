"""DILOCO's spot checks (issue 33, ``verify``) with real GPU-client processes: shadow workers run
a worker's rank again and the server compares their uploads. An honest job agrees in every round,
names nobody and comes back bit for bit as the same job without shadows; a donor that adds noise
to its weights is named in round 0 by the shadows that ran its rank honestly; a shadow killed
mid-job changes nothing of the result. In process over both stores: test_trust_verify.py."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

import zwdx
import mnist
from digests import state_digest
from procs import wait_until
from store_backends import mongo_server, mongo_uri  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow  # a server and three or four GPU-client processes


def job(sdk, train=mnist.train, verify: float = 0.0, world_size: int = 2, wait: bool = True, epochs: int = 1):
    torch.manual_seed(0)
    model = mnist.Net()
    return sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=train,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="DILOCO",
                          strategy=zwdx.Diloco(inner_steps=4, verify=verify, all_reduce=False),
                          resources=zwdx.Resources(world_size=world_size),
                          training=zwdx.Training(epochs=epochs, seed=0), wait=wait,
                          **({"run": zwdx.Run(progress=False, timeout=300)} if wait else {}))


def _train(model, loader, optimizer, epochs, reporter, device, noise: bool, pace: float = 0.3):
    """mnist's training, a step every ``pace`` seconds at least (0.3: long enough for a shadow that
    started later than its worker, with no standby process ready yet on its GPU client, to reach
    its rounds before the job ends; a job does not wait for its shadows); with ``noise``, noise
    added to the weights after every step (test_ddp_verify's liar too)."""
    model.train()
    loss = torch.tensor(0.0)
    for epoch in range(reporter.start_epoch, epochs):
        loader.sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            optimizer.step()
            if noise:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn_like(p) * 0.3)
            if pace:
                time.sleep(pace)
    return loss.item()


def paced_train(model, loader, optimizer, rank, epochs, reporter, device):
    """An honest worker's training, paced (``_train``)."""
    return _train(model, loader, optimizer, epochs, reporter, device, noise=False)


def weights(sdk, job_id: str) -> str:
    return state_digest(sdk.get_trained_model(job_id, mnist.Net()).state_dict())


def spot_checks(sdk, job_id: str) -> list[str]:
    return [line["text"] for line in sdk.get_job_logs(job_id) if line["text"].startswith("diloco spot check")]


def test_an_honest_job_with_every_worker_shadowed_agrees_and_is_the_job_without_shadows(sdk, room, start_client):
    for name in "abcd":
        start_client(name, extra=["--threads", "1"])
    sdk.room_token = room["token"]
    shadowed = job(sdk, train=paced_train, verify=1.0, epochs=2)
    assert shadowed["status"] == "completed", shadowed["reason"]
    record = sdk.get_job(shadowed["job_id"])
    assert record["world_size"] == 2 and len(record["placement"]) == 4
    assert sorted(s["of"] for s in record["shadows"].values()) == [0, 1]
    rounds = [line for line in sdk.get_job_logs(shadowed["job_id"]) if line["text"].startswith("diloco round")]
    members = [r["text"].split("rank(s) ")[1].split(" through")[0] for r in rounds]
    assert set(members) <= {"0, 1", "0", "1", "none"} and "0, 1" in members, rounds  # never a shadow
    for rank, shadow in record["shadows"].items():  # every round it reached before the job ended (it started later)
        assert shadow["agreed"] == list(range(len(shadow["agreed"]))) and not shadow["disagreed"], (rank, shadow)
        assert shadow["agreed"] and shadow["round"] >= shadow["agreed"][-1] and not shadow.get("gone"), (rank, shadow)
    assert shadowed["suspects"] == [] and not record.get("suspects")
    plain = job(sdk, train=paced_train, epochs=2)
    assert plain["status"] == "completed", plain["reason"]
    assert weights(sdk, shadowed["job_id"]) == weights(sdk, plain["job_id"])


def lying_train(model, loader, optimizer, rank, epochs, reporter, device):
    """``_train``, but the process on the GPU client started with two torch threads (the liar's)
    adds noise to its weights after every step: the donor lies, whichever rank it runs, and its
    shadows run the same rank honestly."""
    return _train(model, loader, optimizer, epochs, reporter, device, noise=torch.get_num_threads() == 2)


def test_a_lying_worker_is_named_by_its_two_shadows_in_round_0_and_only_it(sdk, room, start_client):
    named_in_round_0(sdk, room, start_client)


def test_a_lying_worker_is_named_in_round_0_on_mongodb(sdk, room, start_client, mongo_uri):
    named_in_round_0(sdk, room, start_client)


def named_in_round_0(sdk, room, start_client):
    for name in ("a-liar", "b", "c"):  # the placement takes GPU clients in id order: the liar is the worker
        start_client(name, extra=["--threads", "2" if name == "a-liar" else "1"])
    sdk.room_token = room["token"]
    result = job(sdk, train=lying_train, verify=2.0, world_size=1)
    assert result["status"] == "completed", result["reason"]
    record = sdk.get_job(result["job_id"])
    assert {p["rank"]: p["client_id"] for p in record["placement"]}[0] == "client-a-liar"
    assert [s["rank"] for s in result["suspects"]] == [0], result["suspects"]
    named = result["suspects"][0]
    assert named["client_id"] == "client-a-liar" and named["rounds"] == [0]
    assert named["reason"].startswith("spot check, round 0: disagreed with its shadows (ranks 1, 2), which agree "
                                      "with each other"), named
    assert all(s["agreed"] == [] and "0" in s["disagreed"] for s in record["shadows"].values()), record["shadows"]


@pytest.mark.server_args("--client-timeout", "5")
def test_a_shadow_killed_mid_job_changes_nothing_of_the_result(sdk, room, start_client):
    clients = {c.client_id: c for c in (start_client(name, extra=["--threads", "1"]) for name in "abc")}
    sdk.room_token = room["token"]
    job_id = job(sdk, train=paced_train, verify=0.5, wait=False, epochs=2)
    wait_until(lambda: spot_checks(sdk, job_id), 180, what="a first spot check")
    record = sdk.get_job(job_id)
    (rank, shadow), = record["shadows"].items()
    clients[shadow["client_id"]].popen.kill()  # SIGKILL: the GPU client and its shadow process
    result = sdk.wait(job_id, progress=False, timeout=300)
    assert result["status"] == "completed", result["reason"]
    record = sdk.get_job(job_id)
    assert record["restarts"] == 0 and record["shadows"][rank]["gone"], record["shadows"]
    assert {record["ranks"][r]["status"] for r in ("0", "1")} == {"completed"} and not record.get("suspects")
    plain = job(sdk, train=paced_train, epochs=2)
    assert plain["status"] == "completed", plain["reason"]
    assert weights(sdk, job_id) == weights(sdk, plain["job_id"])
