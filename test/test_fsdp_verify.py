"""FSDP's step checks (issue 33, ``verify``) with real GPU-client processes: a shadow rank runs a
rank again under FSDP in a world of one, in step with the job, and every step's gradients are
compared before they are applied (``gpu_client/rank/strategies/fsdp_check.py``; the server's side:
test_trust_fsdp_verify.py). As test_ddp_verify.py for DDP: a donor that adds noise to its weights
is caught at its first lying step, it and its shadow are named, the job is placed again without
them, and what comes back is bit for bit the same job trained honestly with plain FSDP."""
from __future__ import annotations

import pytest

from test_ddp_verify import liar_caught

pytestmark = pytest.mark.slow  # a server and four GPU-client processes


def test_a_lying_fsdp_rank_is_caught_before_its_step_is_applied_and_the_job_trains_again_without_it(
        sdk, room, start_client):
    # Step 0 was honest (the noise comes after the optimizer's step): caught at step 1, in the weights
    # rank 0 holds as the step's forward begins (fsdp_weights.Weights), before any gradient; the shadow
    # (FSDP in a world of one: the whole model) ends with rank 0's gathered weights.
    liar_caught(sdk, room, start_client, "FSDP", "the weights")
