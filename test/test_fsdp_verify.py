"""FSDP's step checks (issue 33, ``verify``) with real GPU-client processes: a shadow rank runs a
rank again under FSDP in a world of one, in step with the job, and every step's gradients are
compared before they are applied (``gpu_client/rank/strategies/fsdp_check.py``; the server's side:
test_trust_fsdp_verify.py). As test_ddp_verify.py for DDP: a donor that adds noise to its weights
is caught at its first lying step, it and its shadow are named, the job is placed again without
them, and what comes back is bit for bit the same job trained honestly with plain FSDP."""
from __future__ import annotations

import pytest
import torch

import zwdx
import mnist
from test_ddp_verify import honest_train, lying_train, weights

pytestmark = pytest.mark.slow  # a server and four GPU-client processes


def job(sdk, train, verify: float = 0.0):
    torch.manual_seed(0)
    model = mnist.Net()
    return sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=train,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism="FSDP",
                          strategy=zwdx.FSDP(verify=verify), resources=zwdx.Resources(world_size=1),
                          training=zwdx.Training(epochs=2, seed=0), wait=True,
                          run=zwdx.Run(progress=False, timeout=300))


def test_a_lying_fsdp_rank_is_caught_before_its_step_is_applied_and_the_job_trains_again_without_it(
        sdk, room, start_client):
    for name in ("a-liar", "b", "c", "d"):  # the placement takes GPU clients in id order: the liar is rank 0
        start_client(name, extra=["--threads", "2" if name == "a-liar" else "1"])
    sdk.room_token = room["token"]
    result = job(sdk, lying_train, verify=1.0)
    assert result["status"] == "completed", result["reason"]
    record = sdk.get_job(result["job_id"])
    assert record["restarts"] == 1, record["restarts"]
    named = {s["rank"]: s for s in result["suspects"]}
    assert sorted(named) == [0, 1], result["suspects"]  # one shadow: which of the two lies cannot be told
    assert named[0]["client_id"] == "client-a-liar" and named[1]["client_id"] == "client-b", named
    # Step 0 was honest (the noise comes after the optimizer's step): caught at step 1, in the weights
    # rank 0 holds as the step's forward begins (fsdp_check.Weights), before any gradient.
    assert all(s["reason"].startswith("step check, step 1, the weights: ") for s in named.values()), named
    assert sorted(p["client_id"] for p in record["placement"]) == ["client-c", "client-d"]
    assert {"client-a-liar", "client-b"} <= set(record["avoid"])
    # The shadow (FSDP in a world of one: the whole model) reported its final weights before rank 0
    # did: the same as rank 0's gathered ones, and the weights that came back are theirs.
    [shadow] = record["shadows"].values()
    assert shadow["fingerprint"] == record["ranks"]["0"]["fingerprint"], record["shadows"]
    assert result["warnings"] == [], result["warnings"]
    plain = job(sdk, honest_train)
    assert plain["status"] == "completed", plain["reason"]
    assert weights(sdk, result["job_id"]) == weights(sdk, plain["job_id"])
