"""DILOCO's robust aggregation: how a round's pseudo-gradients are combined so that a worker
that lies about its own (noise, a forged vector, a scaled one) cannot steer the global weights,
and how a worker that keeps disagreeing is told apart. numpy only: the server uses it on the
uploads (``zwdx.server.diloco``), the workers on what they all-gather (``gpu_client/rank/strategies/peers.py``),
so both paths compute the same numbers.

The rule (``aggregate="robust"``, the default):
  1. clip: every pseudo-gradient is scaled down to at most the round's median norm (norm
     clipping against the median, after Karimireddy et al. 2021); a liar's vector then weighs
     no more than an honest one;
  2. trim: per coordinate, the ``trim`` largest and smallest clipped values are dropped and the
     rest averaged (a coordinate-wise trimmed mean; ``trim`` defaults to (n - 1) // 3: up to a
     third of the workers may lie about any coordinate). With ``trim`` 0 it is the mean of the
     clipped vectors.
``aggregate="mean"`` is the plain mean (DiLoCo's paper; every worker trusted), and so is any
round of fewer than three workers: with two, neither can be outvoted.

Scores, per worker and round (``Combiner.scores``), from the same pass over the frames (the
workers' Gram matrix is summed as they go):
  - ``norm_ratio``: its norm over the round's median norm;
  - ``agreement``: the cosine between its pseudo-gradient and the sum of the others' clipped ones
    (leave-one-out, and leaving out those flagged already).
A worker is *flagged* in a round when, among three or more workers, its norm is above
``NORM_BOUND`` times the median, or, while the workers share a direction (median agreement at
least ``MIN_AGREEMENT``), it opposes that direction (a cosine below -0.2 and below -1/3 of the
median; taken out one at a time). A vector that merely disagrees (a random one) is not flagged:
clipping bounds what it can do, and honest workers disagree so too near convergence. ``zwdx.server.diloco`` names a worker flagged ``suspect_after`` rounds
in a row a suspect and drops it from the job.

What it does not stop: a liar whose vector stays within the honest norms and directions (a
small, steady bias) moves the weights by at most its clipped share each round and is not named;
with two workers neither can be told from the other; colluding workers that are more than
``trim`` per coordinate, or the majority, win.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: A norm this many times the round's median flags its worker.
NORM_BOUND = 3.0
#: While the workers share a direction (their median agreement at least ``MIN_AGREEMENT``), a
#: worker pushing against it flags itself: its agreement below -``AGREEMENT_SHARE`` times that
#: median, and below -``MIN_OPPOSITION`` whatever the median. Only opposition counts: an honest
#: worker whose shard is fit before the others' agrees about zero for rounds on end (measured:
#: bench/robust_diloco.py), and so does a random vector, whose harm clipping bounds.
AGREEMENT_SHARE = 1 / 3
MIN_AGREEMENT = 0.1
MIN_OPPOSITION = 0.2


def default_trim(n: int) -> int:
    """Values trimmed per side and coordinate among ``n`` workers: (n - 1) // 3."""
    return max(0, (n - 1) // 3)


def clip_scales(norms: list[float]) -> list[float]:
    """The factor each vector is scaled by: down to the median norm, never up."""
    if not norms:
        return []
    bound = float(np.median(norms))
    return [min(1.0, bound / norm) if norm > 0 else 1.0 for norm in norms]


@dataclass(frozen=True)
class Scores:
    norm: float
    norm_ratio: float
    agreement: float
    #: Why it is flagged this round (None: it is not).
    flag: str | None = None

    def as_dict(self) -> dict:
        return {"norm": round(self.norm, 6), "norm_ratio": round(self.norm_ratio, 4),
                "agreement": round(self.agreement, 4), "flag": self.flag}


class Combiner:
    """One round's aggregate, a frame (the same slice of every worker's vector) at a time.

    ``norms``: each worker's whole-vector norm, known before the frames (the server reads every
    upload once when it comes in; workers all-gather them first)."""

    def __init__(self, norms: list[float], robust: bool = True, trim: int | None = None):
        self.n, self.robust = len(norms), robust and len(norms) >= 3  # with two, no one can be outvoted
        self.norms = [float(v) for v in norms]
        self.scales = np.asarray(clip_scales(self.norms) if self.robust else [1.0] * self.n, np.float64)
        wanted = default_trim(self.n) if trim is None else trim
        self.trim = min(wanted, (self.n - 1) // 2) if self.robust else 0  # at least one value stays
        self._gram = np.zeros((self.n, self.n))  # <g_i, g_j>, summed over the frames

    def frame(self, frames: list[np.ndarray]) -> np.ndarray:
        """The aggregate of this slice (float32); the scores' sums kept."""
        stack = np.stack(frames).astype(np.float64)
        self._gram += stack @ stack.T
        if not self.robust:  # float32, summed in order: the plain mean's bytes as they always were
            total = np.array(frames[0], np.float32)
            for frame in frames[1:]:
                total += frame
            return total / np.float32(self.n)
        clipped = stack * self.scales[:, None]
        if self.trim:
            return np.sort(clipped, axis=0)[self.trim:self.n - self.trim].mean(axis=0).astype(np.float32)
        return (clipped.sum(axis=0) / self.n).astype(np.float32)

    def _agreement(self, i: int, others: list[int]) -> float:
        """The cosine between worker ``i``'s vector and the sum of ``others``' clipped ones."""
        c = self.scales[others]
        dot = float(self._gram[i, others] @ c)
        square = float(c @ self._gram[np.ix_(others, others)] @ c)
        norm_i = self._gram[i, i] ** 0.5
        return dot / (norm_i * square ** 0.5) if norm_i > 0 and square > 0 else 0.0

    def scores(self) -> list[Scores]:
        """Each worker's scores and flag. Norm first: a vector above ``NORM_BOUND`` times the
        median is flagged and leaves the reference; then, while three or more remain, the one
        that agrees least with the rest of the reference is flagged and leaves it if its
        agreement is below zero or below ``AGREEMENT_SHARE`` of the reference's median (one at a
        time, so that a liar pulling the reference does not get an honest worker flagged)."""
        median = float(np.median(self.norms)) if self.norms else 0.0
        ratios = [norm / median if median > 0 else 0.0 for norm in self.norms]
        why: dict[int, str] = {}
        if self.n >= 3:
            why = {i: f"its pseudo-gradient's norm is {r:.1f}x the round's median"
                   for i, r in enumerate(ratios) if r > NORM_BOUND}
        reference = [i for i in range(self.n) if i not in why]
        while self.n >= 3 and len(reference) >= 3 and len(why) < (self.n - 1) // 2 + 1:
            agree = {i: self._agreement(i, [j for j in reference if j != i]) for i in reference}
            worst = min(agree, key=agree.get)
            middle = float(np.median(list(agree.values())))
            if not (middle >= MIN_AGREEMENT and agree[worst] < -max(MIN_OPPOSITION, AGREEMENT_SHARE * middle)):
                break
            why[worst] = (f"its pseudo-gradient opposes the others' (cosine {agree[worst]:.2f}, the "
                          f"round's median {middle:.2f})")
            reference.remove(worst)
        return [Scores(self.norms[i], ratios[i], self._agreement(i, [j for j in reference if j != i]), why.get(i))
                for i in range(self.n)]


def flags(scores: list[Scores]) -> list[str | None]:
    """Why each worker is flagged this round (None: it is not). With fewer than three workers
    none is: which one lies cannot be told."""
    return [s.flag for s in scores]


__all__ = ["NORM_BOUND", "AGREEMENT_SHARE", "MIN_AGREEMENT", "MIN_OPPOSITION", "default_trim", "clip_scales", "Scores", "Combiner", "flags"]
