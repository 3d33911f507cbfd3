"""Trace families: populations unlike the generator's default, to test the planner where it could lose.

Each family is the generator (``tracegen.generate``) with some of its draws replaced; the default draws
are made first in the same order, so the family ``generator`` is the original trace bit for bit, and the
others redraw what they change from a second stream seeded by (seed, family). Documented in
docs/planner.md ("Trace families").
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Family:
    name: str
    about: str
    load: float = 0.85
    user_bias: tuple[float, float] | None = None  # uniform(lo, hi) x the optimum instead of lognormal(0, 0.6)
    user_sigma: float | None = None  # lognormal(0, sigma) x the optimum
    cpu_over: tuple[float, float] | None = None  # lognormal(ln mu, sigma) of CPU requested / needed
    mem_over: tuple[float, float] | None = None  # lognormal(ln mu, sigma) of memory requested / peak
    under_share: float | None = None  # chance of memory asked between start and peak (None: the default)
    growth: tuple[float, float] | None = None  # uniform range of the tables' growth fraction
    bandwidth: tuple[float, ...] | None = None  # bytes/s choices
    dims: tuple[int, ...] | None = None  # embedding dims choices
    gpus: tuple[int, ...] | None = None  # GPUs per node choices (uniform)
    burst: int = 0  # jobs arrive in bursts of this many at one time (0: Poisson)
    # --- the users who hurt: per-run draws of the ground truth (well-sized requests) ---
    step_cv: tuple[float, float] | None = None  # uniform range of the step time's variation
    warmup_s: tuple[float, float] | None = None  # uniform range of every round's half-speed warm-up
    truth_drift: float = 0.0  # each run's compute and all-to-all cost x lognormal(0, this): history lies
    duration_s: tuple[float, float] | None = None  # uniform range of the run time at the request
    skew: tuple[float, float] | None = None  # uniform range of the compute factor after a mid-run change
    worker_noise: bool = False  # every member's step varies as a PAI worker's (worker_noise.py)


WELL_SIZED = {"user_sigma": 0.15, "cpu_over": (1.5, 0.15), "mem_over": (1.5, 0.15), "under_share": 0.0}


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("generator", "the default generator at load 0.85"),
        Family(
            "right-sized",
            "users size their jobs well: nodes within ~15% of the optimum, CPU and memory 1.3-1.6x the need, "
            "no under-provisioned memory",
            user_sigma=0.15,
            cpu_over=(1.5, 0.15),
            mem_over=(1.5, 0.15),
            under_share=0.0,
        ),
        Family(
            "comm-bound",
            "communication-bound jobs (slow network, wide embeddings) with 3-6x too many nodes requested",
            user_bias=(3.0, 6.0),
            bandwidth=(0.3e9, 0.625e9, 1.25e9),
            dims=(128, 256),
        ),
        Family(
            "oom-heavy",
            "tables that grow 50-150% over the run, half the jobs ask for memory just above the start size",
            under_share=0.5,
            growth=(0.5, 1.5),
        ),
        Family("bursty", "arrivals in bursts of 25 jobs at one time, the same load", burst=25),
        Family("low-load", "the generator at load 0.5", load=0.5),
        Family("high-load", "the generator at load 1.2", load=1.2),
        Family("hetero-gpu", "GPUs per node drawn evenly from 1, 2, 4 and 8", gpus=(1, 2, 4, 8)),
        Family(
            "noisy",
            "right-sized users; step times vary 5-20% (CV) sample to sample",
            step_cv=(0.05, 0.2),
            **WELL_SIZED,
        ),
        Family(
            "slow-warmup",
            "right-sized users; every round's first 2-10 minutes run at half speed",
            warmup_s=(120.0, 600.0),
            **WELL_SIZED,
        ),
        Family(
            "history-lies",
            "right-sized users of recurring jobs whose model changed: each run's compute "
            "and all-to-all cost x lognormal(0, 0.5), so the history of earlier runs misleads",
            truth_drift=0.5,
            **WELL_SIZED,
        ),
        Family(
            "short",
            "right-sized users; runs of 5-11.7 minutes, shorter than two profiling windows",
            duration_s=(300.0, 700.0),
            **WELL_SIZED,
        ),
        Family(
            "data-skew",
            "right-sized users; at 20-80% of the work a sample's compute changes 0.5-2x",
            skew=(0.5, 2.0),
            **WELL_SIZED,
        ),
        Family(
            "pai-noise",
            "right-sized users; every member's step varies as a worker's of the Alibaba PAI "
            "trace (the synchronous step waits for the slowest)",
            worker_noise=True,
            **WELL_SIZED,
        ),
    )
}


def family_rng(seed: int, family: Family) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(family.name.encode())])


def apply_template(t: dict, fam: Family, rng: np.random.Generator, max_gpus: int) -> dict:
    """The template's draws that the family replaces (the job's shapes and the user's habits)."""
    t = dict(t)
    if fam.bandwidth:
        t["bandwidth"] = float(rng.choice(fam.bandwidth))
    if fam.dims:
        t["dim"] = int(rng.choice(fam.dims))
    if fam.gpus:
        t["gpus_per_node"] = min(int(rng.choice(fam.gpus)), max_gpus)
    if fam.growth:
        t["mem_growth_frac"] = float(rng.uniform(*fam.growth))
    if fam.user_bias:
        t["user_bias"] = float(rng.uniform(*fam.user_bias))
    elif fam.user_sigma is not None:
        t["user_bias"] = float(rng.lognormal(0.0, fam.user_sigma))
    if fam.cpu_over:
        t["cpu_over"] = float(rng.lognormal(math.log(fam.cpu_over[0]), fam.cpu_over[1]))
    if fam.mem_over:
        t["mem_over"] = float(rng.lognormal(math.log(fam.mem_over[0]), fam.mem_over[1]))
    if fam.under_share is not None:
        t["under_share"] = fam.under_share
    return t


def apply_run(truth: dict, fam: Family, rng: np.random.Generator) -> dict:
    """The per-run ground truth a family changes (drawn from the family's stream, after the defaults)."""
    truth = dict(truth)
    if fam.truth_drift:
        truth["t_compute"] *= float(rng.lognormal(0.0, fam.truth_drift))
        truth["t_a2a_eff"] *= float(rng.lognormal(0.0, fam.truth_drift))
    if fam.step_cv:
        truth["step_cv"] = float(rng.uniform(*fam.step_cv))
    if fam.warmup_s:
        truth["warmup_s"] = float(rng.uniform(*fam.warmup_s))
    if fam.skew:
        truth["skew_at_frac"] = float(rng.uniform(0.2, 0.8))
        truth["skew_factor"] = float(rng.uniform(*fam.skew))
    if fam.worker_noise:
        truth["worker_noise"] = 1
    return truth


def arrival_times(n: int, span: float, fam: Family, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals over ``span`` seconds, or the same number in bursts of ``fam.burst`` jobs."""
    if not fam.burst:
        gaps = rng.exponential(span / n, n)
        return np.cumsum(gaps) - gaps[0]
    bursts = math.ceil(n / fam.burst)
    gaps = rng.exponential(span / bursts, bursts)
    starts = np.cumsum(gaps) - gaps[0]
    return np.repeat(starts, fam.burst)[:n]
