"""Per-worker step-time noise as measured on a real cluster: the Alibaba PAI trace.

The table is the quantile function of one worker's mini-batch time over its own median, pooled over the
workers of the three single-class 10-worker jobs of the Alibaba PAI trace ("Mini-batch Time of Workers in
Distributed Training Jobs on PAI", alibaba/clusterdata, 7,890 samples); the fourth job, two classes of
workers 3-4x apart, is a straggler population, not noise. A synchronous step waits for the slowest
member, so this noise alone makes a wider job slower: the planner must not read it as scaling.
"""

from __future__ import annotations

import numpy as np

QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)
RATIO = (0.883, 0.918, 0.945, 0.96, 0.977, 0.986, 0.993, 1.0, 1.007, 1.015, 1.026, 1.05, 1.081, 1.249, 2.328)


def draw(rng: np.random.Generator, n: int) -> list[float]:
    """``n`` workers' step time / their median, drawn from the table (linear between its quantiles)."""
    return [float(x) for x in np.interp(rng.uniform(size=n), QUANTILES, RATIO)]
