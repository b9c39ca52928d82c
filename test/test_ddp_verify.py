"""DDP's step checks (issue 33, ``verify``) with real GPU-client processes: a shadow rank runs a
rank again in step with the job, and every step's gradients are compared before they are
applied (``gpu_client/rank/strategies/step_check.py``; the server's side: ``zwdx/server/jobs``).
A donor that adds noise to its weights is caught at its first lying step: it and its shadow are
named (one shadow cannot tell which of the two lies), the job is placed again without them, and
what comes back is bit for bit the same job trained honestly without shadows. The rank side
alone: test_step_check.py; the server's, over both stores: test_trust_step_check.py."""
from __future__ import annotations

import pytest
import torch

import zwdx
import mnist
from digests import state_digest
from test_diloco_verify import _train as paced_train  # a step every ``pace`` seconds at least

pytestmark = pytest.mark.slow  # a server and four GPU-client processes


def job(sdk, train, verify: float = 0.0, world_size: int = 1, mode: str = "DDP"):
    """The example's job, with ``mode``'s step checks (``verify``): DDP, or FSDP (test_fsdp_verify)."""
    torch.manual_seed(0)
    model = mnist.Net()
    return sdk.submit_job(model=model, data_loader_func=mnist.create_loader, train_func=train,
                          optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), parallelism=mode,
                          strategy=getattr(zwdx, mode)(verify=verify), resources=zwdx.Resources(world_size=world_size),
                          training=zwdx.Training(epochs=2, seed=0), wait=True,
                          run=zwdx.Run(progress=False, timeout=300))


def _train(model, loader, optimizer, epochs, reporter, device, noise: bool):
    """test_diloco_verify's training (with ``noise``, noise added to the weights after every step),
    unpaced (the shadows run in step), on one torch thread whatever the GPU client gave the rank (the
    same arithmetic as every other rank: bitwise checks hold)."""
    torch.set_num_threads(1)
    return paced_train(model, loader, optimizer, epochs, reporter, device, noise, pace=0)


def honest_train(model, loader, optimizer, epochs, reporter, device):
    return _train(model, loader, optimizer, epochs, reporter, device, noise=False)


def lying_train(model, loader, optimizer, epochs, reporter, device):
    """``_train``, but the process on the GPU client started with two torch threads (the liar's)
    adds noise to its weights after every step: the donor lies, whichever rank it runs, and its
    shadow runs the same rank honestly."""
    liar = torch.get_num_threads() == 2  # read before ``_train`` sets one thread
    return _train(model, loader, optimizer, epochs, reporter, device, noise=liar)


def weights(sdk, job_id: str) -> str:
    return state_digest(sdk.get_trained_model(job_id, mnist.Net()).state_dict())


def test_a_lying_rank_is_caught_before_its_step_is_applied_and_the_job_trains_again_without_it(
        sdk, room, start_client):
    # Step 0's gradients were honest (the noise comes after the optimizer's step): caught at step 1.
    liar_caught(sdk, room, start_client, "DDP", "bucket 0")


def liar_caught(sdk, room, start_client, mode: str, where: str) -> None:
    """Four GPU clients, the first a liar; a ``mode`` job with one shadow: the liar and its shadow
    named at step 1 (``where``: what disagreed), the job placed again on the two others, and its
    weights the same job's trained honestly without shadows."""
    for name in ("a-liar", "b", "c", "d"):  # the placement takes GPU clients in id order: the liar is rank 0
        start_client(name, extra=["--threads", "2" if name == "a-liar" else "1"])
    sdk.room_token = room["token"]
    result = job(sdk, lying_train, verify=1.0, mode=mode)
    assert result["status"] == "completed", result["reason"]
    record = sdk.get_job(result["job_id"])
    assert record["restarts"] == 1, record["restarts"]
    named = {s["rank"]: s for s in result["suspects"]}
    assert sorted(named) == [0, 1], result["suspects"]  # one shadow: which of the two lies cannot be told
    assert named[0]["client_id"] == "client-a-liar" and named[1]["client_id"] == "client-b", named
    assert all(s["reason"].startswith(f"step check, step 1, {where}: ") for s in named.values()), named
    assert sorted(p["client_id"] for p in record["placement"]) == ["client-c", "client-d"]
    assert {"client-a-liar", "client-b"} <= set(record["avoid"])
    # The shadow reported its final weights before rank 0 did (``Checked.report_end``): the same,
    # and the weights that came back are theirs (no warning: ``suspects.compare_upload``).
    [shadow] = record["shadows"].values()
    assert shadow["fingerprint"] == record["ranks"]["0"]["fingerprint"], record["shadows"]
    assert result["warnings"] == [], result["warnings"]
    # The lie was stopped before it was applied, and the attempt after it agreed at every step:
    # the weights are those of the same job, trained honestly, without shadows.
    plain = job(sdk, honest_train, mode=mode)
    assert plain["status"] == "completed", plain["reason"]
    assert weights(sdk, result["job_id"]) == weights(sdk, plain["job_id"])
