"""The ranks' fingerprint of their weights is the digest the tests compute on their own
(test/digests.py): sha256 over names and raw values, in name order, whatever the dtype."""
import torch

from digests import state_digest
from gpu_client.rank.strategies.parallel import fingerprint


def test_a_ranks_fingerprint_is_the_tests_own_digest_of_the_same_weights():
    g = torch.Generator().manual_seed(0)
    state = {"b.weight": torch.randn(3, 5, generator=g), "a.bias": torch.randn(7, generator=g).to(torch.bfloat16),
             "a.empty": torch.zeros(0), "c.steps": torch.arange(4), "d.t": torch.randn(4, 6, generator=g).t()}
    assert fingerprint(state) == state_digest(state)
    changed = dict(state, **{"b.weight": state["b.weight"].clone()})
    changed["b.weight"][2, 4] += 1e-6
    assert fingerprint(changed) != fingerprint(state) and state_digest(changed) != state_digest(state)
