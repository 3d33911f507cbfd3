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
        ),  # fmt: skip
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


def arrival_times(n: int, span: float, fam: Family, rng: np.random.Generator) -> np.ndarray:
    """Poisson arrivals over ``span`` seconds, or the same number in bursts of ``fam.burst`` jobs."""
    if not fam.burst:
        gaps = rng.exponential(span / n, n)
        return np.cumsum(gaps) - gaps[0]
    bursts = math.ceil(n / fam.burst)
    gaps = rng.exponential(span / bursts, bursts)
    starts = np.cumsum(gaps) - gaps[0]
    return np.repeat(starts, fam.burst)[:n]
