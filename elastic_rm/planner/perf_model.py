"""Resource-performance model of synchronous TorchRec training, fitted by NNLS.

One step of a fixed global batch B on w nodes of mean compute capacity c (GPUs, or cores/16 on CPU nodes):

    T(w) = a1 * B/(w*c)                      compute: each node runs B/w samples (fwd/bwd, lookups)
         + a2 * B*S*(w-1)/(w^2 * bw)         embedding all-to-all: B/w pooled vectors of S bytes,
                                             (w-1)/w of them leave
         + a3 * 2*D*(w-1)/(w * bw)           dense all-reduce: ring, 2(w-1)/w of D bytes
         + a4                                fixed: optimizer step, data wait, launch overheads

Throughput = B / T. The coefficients are non-negative (NNLS, ``nnls.py``: the same to the last bit on every
CPU), so every term stays physical.
With one configuration the terms are not identifiable; a prior (history, or a physical default: both
communication coefficients 1, i.e. wire speed) enters as extra NNLS rows whose weight fades as distinct
configurations are observed. This re-derives the paper's PS model (reference §2.2) for all-to-all sharding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .nnls import dot, nnls

N_TERMS = 4
TERMS = ("compute", "all_to_all", "all_reduce", "fixed")


@dataclass(frozen=True)
class Shape:
    """The job constants that enter the features."""

    batch: float
    emb_bytes_per_sample: float
    dense_bytes: float
    bandwidth: float


@dataclass(frozen=True)
class Sample:
    """One observed configuration: world size, mean capacity, measured step time (s)."""

    world: int
    capacity: float
    step_s: float


def features(shape: Shape, world: int, capacity: float) -> np.ndarray:
    w = max(int(world), 1)
    c = max(capacity, 1e-6)
    return np.array(
        [
            shape.batch / (w * c),
            shape.batch * shape.emb_bytes_per_sample * (w - 1) / (w * w * shape.bandwidth),
            2.0 * shape.dense_bytes * (w - 1) / (w * shape.bandwidth),
            1.0,
        ]
    )


@dataclass(frozen=True)
class Fit:
    """Fitted coefficients with their quality: R^2 (nan when undefined), relative RMS residual."""

    coef: tuple[float, ...]
    r2: float
    rel_rmse: float
    n_samples: int
    worlds: tuple[int, ...]  # distinct world sizes observed

    def step_s(self, shape: Shape, world: int, capacity: float) -> float:
        return dot(features(shape, world, capacity), self.coef)

    def throughput(self, shape: Shape, world: int, capacity: float) -> float:
        return shape.batch / max(self.step_s(shape, world, capacity), 1e-9)

    def rel_sigma(self, world: int) -> float:
        """Relative 1-sigma uncertainty of a prediction: residual plus an extrapolation penalty."""
        base = max(self.rel_rmse, 0.02)
        if not self.worlds:
            return 0.5
        dist = min(abs(math.log(world / w)) for w in self.worlds)
        return base + 0.25 * dist / math.sqrt(len(self.worlds))

    def band(self, shape: Shape, world: int, capacity: float, z: float = 2.0) -> tuple[float, float, float]:
        """(low, predicted, high) throughput in samples/s."""
        p = self.throughput(shape, world, capacity)
        s = self.rel_sigma(world)
        return max(p * (1 - z * s), 0.0), p, p * (1 + z * s)

    def confidence(self, world: int) -> float:
        return float(min(max(1.0 - 2.0 * self.rel_sigma(world), 0.0), 1.0))


def default_prior(shape: Shape, sample: Sample) -> np.ndarray:
    """Physical prior scaled to one observation: wire-speed communication, 5% fixed, compute the rest."""
    x = features(shape, sample.world, sample.capacity)
    a2, a3 = 1.0, 1.0
    a4 = 0.05 * sample.step_s
    rest = sample.step_s - a2 * x[1] - a3 * x[2] - a4
    a1 = max(rest, 0.3 * sample.step_s) / x[0]
    return np.array([a1, a2, a3, a4])


def fit(
    shape: Shape, samples: list[Sample], prior: np.ndarray | None = None, prior_weight: float = 1.0
) -> Fit:
    """NNLS fit of the coefficients to samples; ``prior`` (coefficients) regularises unidentified terms.

    The prior rows are expressed in seconds of each term at the mean observed configuration and weighted
    by ``prior_weight / distinct_worlds``, so data wins as soon as it can identify the terms.
    """
    if not samples:
        raise ValueError("fit needs at least one sample")
    a = [[float(v) for v in features(shape, s.world, s.capacity)] for s in samples]
    t = [s.step_s for s in samples]
    worlds = tuple(sorted({s.world for s in samples}))
    if prior is None:
        prior = default_prior(shape, samples[0])
    rows, target = a, t
    if prior_weight > 0:  # one row per term: lam * scale_j * coef_j = lam * scale_j * prior_j
        scale = [max(math.fsum(col) / len(a), 1e-12) for col in zip(*a, strict=True)]
        lam = math.sqrt(prior_weight * len(samples) / len(worlds) ** 2)
        eye = [[lam * scale[i] if i == j else 0.0 for j in range(N_TERMS)] for i in range(N_TERMS)]
        rows = a + eye
        target = t + [lam * scale[j] * float(prior[j]) for j in range(N_TERMS)]
    coef, _ = nnls(rows, target)
    mean = math.fsum(t) / len(t)
    ss_res = math.fsum((dot(r, coef) - v) ** 2 for r, v in zip(a, t, strict=True))
    ss_tot = math.fsum((v - mean) ** 2 for v in t)
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 1e-12 * max(mean**2, 1e-12) else float("nan")
    rel = math.sqrt(ss_res / len(t)) / max(mean, 1e-12)
    return Fit(tuple(float(c) for c in coef), r2, rel, len(samples), worlds)


def marginal_gains(fit_: Fit, shape: Shape, capacity: float, lo: int, hi: int) -> dict[int, float]:
    """Throughput at each world size in [lo, hi]."""
    return {w: fit_.throughput(shape, w, capacity) for w in range(max(lo, 1), hi + 1)}


def best_world(
    fit_: Fit, shape: Shape, capacity: float, lo: int, hi: int, min_gain: float
) -> tuple[int, float]:
    """World size in [lo, hi] by the marginal-gain rule; returns (world, predicted throughput).

    Starting from ``lo``, nodes are added while each brings at least ``min_gain`` x the average node's
    throughput at the accepted size (a group of nodes may clear the bar together: going from 1 to 2
    nodes adds communication that later nodes amortise). That is the paper's/DLRover's 0.2 speed-ratio
    rule, applied to the model instead of to the last scaling step. Churn is the caller's concern (see
    stage 2).
    """
    tp = marginal_gains(fit_, shape, capacity, lo, hi)
    w = max(lo, 1)
    k = w + 1
    while k <= hi:  # a jump of several nodes counts when together they clear the bar (1 -> 2 adds comm)
        if tp[k] - tp[w] >= min_gain * (k - w) * tp[w] / w:
            w = k
        k += 1
    return w, tp[w]
