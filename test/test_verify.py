"""DILOCO's spot checks, in process: how many shadows, which workers they run again, when two
uploads agree, and who is named when they do not (``zwdx.verify``'s rule)."""
from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from zwdx import codec
from zwdx.verify import Opinion, agree, count, decide, distance, draw


def opinion(who: int, values) -> Opinion:
    values = np.asarray(values, np.float32)
    return Opinion(who, hashlib.sha256(codec.encode(values, "none")).hexdigest(), values)


@pytest.mark.parametrize("verify,workers,want", [(0, 4, 0), (0.1, 4, 1), (0.25, 4, 1), (0.5, 3, 2), (1.0, 2, 2),
                                                 (2.0, 1, 2), (1.5, 2, 3)])
def test_the_number_of_shadows_is_the_ceiling_of_the_fraction_and_at_least_one(verify, workers, want):
    assert count(verify, workers) == want


def test_shadows_spread_over_the_workers_and_the_extra_ones_are_drawn():
    assert draw(2, 2) == [0, 1] and draw(1, 2) == [0, 0]
    seen = {tuple(draw(4, 1, random.Random(seed))) for seed in range(40)}
    assert seen == {(0,), (1,), (2,), (3,)}  # each worker can be the one: the worker cannot know
    assert sorted(draw(3, 5, random.Random(1))).count(0) >= 1 and len(draw(3, 5)) == 5


def test_distance_is_relative_to_the_larger_norm():
    assert distance(np.zeros(3), np.zeros(3)) == 0
    assert distance(np.array([3.0, 4.0]), np.array([3.0, 4.0])) == 0
    assert distance(np.array([1.0, 0.0]), np.array([0.0, 0.0])) == 1.0
    assert distance(np.array([2.0, 0.0]), np.array([1.0, 0.0])) == pytest.approx(0.5)
    assert distance(np.ones(2), np.ones(3)) == float("inf")


def test_identical_bytes_agree_and_any_other_value_does_not_unless_within_the_tolerance():
    a, b = opinion(0, [1.0, 2.0, 3.0]), opinion(2, [1.0, 2.0, 3.0])
    assert agree(a, b) == (True, 0.0)
    c = opinion(2, [1.0, 2.0, 3.0 + 1e-6])  # the same length, one value off: a length check passes it
    ok, d = agree(a, c)
    assert not ok and 0 < d < 1e-6
    assert agree(a, c, tolerance=1e-5)[0]


def test_a_worker_and_its_shadow_that_agree_name_nobody():
    distances, named = decide(opinion(1, [1, 2]), [opinion(3, [1, 2])])
    assert distances == {3: 0.0} and named == {}


def test_a_disagreement_with_one_shadow_and_no_third_opinion_names_both():
    _, named = decide(opinion(1, [1, 2]), [opinion(3, [1, 5])])
    assert sorted(named) == [1, 3]
    assert "disagreed with its shadow (relative distance 0.588)" in named[1] and "cannot be told" in named[1]


def test_the_robust_rule_flagging_the_worker_names_it_alone():
    _, named = decide(opinion(1, [1, 2]), [opinion(3, [1, 5])], flagged=True)
    assert list(named) == [1] and "robust rule" in named[1]


def test_two_shadows_that_agree_outvote_the_worker():
    _, named = decide(opinion(0, [9, 9]), [opinion(2, [1, 2]), opinion(3, [1, 2])])
    assert list(named) == [0] and "agree with each other" in named[0]


def test_a_shadow_the_other_shadow_contradicts_is_named_alone():
    _, named = decide(opinion(0, [1, 2]), [opinion(2, [1, 2]), opinion(3, [7, 2])])
    assert list(named) == [3] and "another shadow confirmed" in named[3]


def test_two_shadows_that_disagree_with_everyone_name_all_three():
    _, named = decide(opinion(0, [1, 2]), [opinion(2, [5, 2]), opinion(3, [1, 7])])
    assert sorted(named) == [0, 2, 3]
