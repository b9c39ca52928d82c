"""DILOCO's spot checks (``verify``): shadow workers, BOINC's redundant computing. A shadow is one
more GPU client slot of the job that runs a worker's rank again, under the same rank identity
(its data shard, its seeds, its ``RankSpec``), so that with the same torch, thread count and
hardware it computes the same pseudo-gradients, bit for bit. Its uploads are compared with the
worker's and never enter a round's average. numpy only: the server's side is
``zwdx.server.shadows``; this module holds what can be said without a store.

    count(verify, workers)          how many shadows a job of ``workers`` workers gets
    draw(workers, n, rng)           which workers they shadow (the server's own randomness)
    distance(a, b)                  the relative L2 distance of two pseudo-gradients
    Opinion / decide(...)           who is named when a worker and its shadows disagree

The decision rule, per worker and round, once its upload and at least one shadow's are in (two
uploads *agree* when their bytes are identical, or their relative distance is within
``verify_tolerance``):
  1. every shadow agrees with the worker: nobody is named;
  2. a shadow agrees with the worker: the shadows that do not are named, alone;
  3. no shadow agrees with the worker, but two shadows agree with each other: the worker alone;
  4. no shadow agrees with the worker, and the round's robust rule flagged the worker
     (``zwdx.robust.flags``; a shadow is never in the average, so never flagged): the worker alone;
  5. otherwise the worker and its disagreeing shadows are named together: which one lies
     cannot be told.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

#: Uploads whose relative distance is at most this agree (``verify_tolerance``'s default:
#: bitwise, which holds on CPUs with the same torch and thread count).
BITWISE = 0.0


def count(verify: float, workers: int) -> int:
    """Shadows of a job of ``workers`` workers: ceil(verify * workers), at least 1 when on."""
    if verify <= 0 or workers <= 0:
        return 0
    return max(1, math.ceil(verify * workers - 1e-9))


def draw(workers: int, n: int, rng: random.Random | None = None) -> list[int]:
    """The worker each of ``n`` shadows runs again: every worker ``n // workers`` times, and
    ``n % workers`` workers drawn at random once more; never told to the workers."""
    rng = rng or random.SystemRandom()
    whole, extra = divmod(n, workers)
    return sorted([w for w in range(workers) for _ in range(whole)] + rng.sample(range(workers), extra))


def distance(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / max(||a||, ||b||) (float64); 0 for two zero vectors, inf for other sizes."""
    if a.shape != b.shape:
        return math.inf
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    scale = max(float(np.linalg.norm(a64)), float(np.linalg.norm(b64)))
    diff = float(np.linalg.norm(a64 - b64))
    return 0.0 if diff == 0 else (diff / scale if scale else math.inf)


@dataclass(frozen=True)
class Opinion:
    """One upload of a round: whose (a worker's rank, or a shadow's slot), its sha256 and its values."""
    who: int
    sha256: str
    values: np.ndarray


def agree(a: Opinion, b: Opinion, tolerance: float = BITWISE) -> tuple[bool, float]:
    """Whether two uploads agree, and their relative distance (0 for identical bytes)."""
    if a.sha256 == b.sha256:
        return True, 0.0
    d = distance(a.values, b.values)
    return d <= tolerance, d


def decide(worker: Opinion, shadows: list[Opinion], flagged: bool = False,
           tolerance: float = BITWISE) -> tuple[dict[int, float], dict[int, str]]:
    """The rule of the module's docstring for one worker's round: each shadow's distance to the
    worker, and who is named (``who`` -> why, empty when they agree)."""
    measured = {s.who: agree(worker, s, tolerance) for s in shadows}
    distances = {who: d for who, (_, d) in measured.items()}
    odd = [s for s in shadows if not measured[s.who][0]]
    if not odd:
        return distances, {}
    if len(odd) < len(shadows):  # a shadow backs the worker
        return distances, {s.who: f"disagreed with the worker it shadows (rank {worker.who}), which another "
                                  f"shadow confirmed (relative distance {distances[s.who]:.3g})" for s in odd}
    pairs = [(a, b) for i, a in enumerate(odd) for b in odd[i + 1:] if agree(a, b, tolerance)[0]]
    first = min(distances.values())
    if pairs:
        return distances, {worker.who: f"disagreed with its shadows (ranks {', '.join(str(s.who) for s in odd)}), "
                                       f"which agree with each other (relative distance {first:.3g})"}
    if flagged:
        return distances, {worker.who: f"disagreed with its shadow (relative distance {first:.3g}) and was "
                                       f"flagged by the round's robust rule"}
    named = {worker.who: f"disagreed with its shadow (relative distance {first:.3g}); which one lies cannot "
                         f"be told"}
    named.update({s.who: f"disagreed with the worker it shadows (rank {worker.who}, relative distance "
                         f"{distances[s.who]:.3g}); which one lies cannot be told" for s in odd})
    return distances, named


__all__ = ["BITWISE", "count", "draw", "distance", "Opinion", "agree", "decide"]
