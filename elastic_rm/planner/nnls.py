"""Non-negative least squares for the few terms of the planner's models, the same to the last bit on any CPU.

scipy's ``nnls`` and numpy's ``@`` run on BLAS/LAPACK, whose kernels OpenBLAS picks by CPU at run time
(AVX2 on one machine, AVX-512 on another); they sum in different orders and round differently in the
last bits. A simulated cluster feeds every fit into the next decision and the next job's warm start, so
those bits grew into different decisions: the planner benchmark's seed 5 (generator family) gave another
mean JCT with OpenBLAS's SkylakeX kernels than with its Haswell ones, on the same code. Here every sum is
``math.fsum`` (correctly rounded, so independent of order) and every other step an IEEE operation in a
fixed order.

With at most a handful of unknowns the exact solution is found by trying every set of free terms: the
NNLS optimum is the unconstrained least-squares solution on its own support, so it is the feasible
(non-negative) subset solution with the smallest residual; when the solution on all terms is non-negative,
it is that one (the common case). Each subset is solved on the normal equations of the column-normalised
matrix (as many equations as free terms, by Gaussian elimination with partial pivoting).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

MAX_TERMS = 6  # 2**6 subsets; the models here have 3 and 4 terms
_SINGULAR = 1e-12  # a pivot below this (the columns have unit norm) means the subset is dependent


def dot(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The correctly rounded sum of products (the same on every CPU, whatever the order)."""
    if len(xs) != len(ys):
        raise ValueError(f"dot of {len(xs)} and {len(ys)} values")
    return math.fsum(map(operator.mul, xs, ys))


def nnls(rows: Sequence[Sequence[float]], target: Sequence[float]) -> tuple[list[float], float]:
    """Coefficients x >= 0 minimising ||rows @ x - target||, and that norm (as scipy.optimize.nnls)."""
    n = len(rows[0]) if rows else 0
    if not 0 < n <= MAX_TERMS or len(rows) != len(target):
        raise ValueError(
            f"nnls needs 1..{MAX_TERMS} columns and one target per row, got {n} and {len(target)}"
        )
    cols = [[float(r[j]) for r in rows] for j in range(n)]
    norms = [math.sqrt(dot(c, c)) for c in cols]
    unit = [[v / s for v in c] if s > 0 else c for c, s in zip(cols, norms, strict=True)]
    gram = [[dot(unit[i], unit[j]) for j in range(n)] for i in range(n)]
    rhs = [dot(u, target) for u in unit]
    best: list[float] = [0.0] * n
    best_res = math.sqrt(dot(target, target))
    full = (1 << n) - 1  # first: when the unconstrained solution is non-negative it is the optimum
    for mask in [full] + list(range(1, full)):
        free = [j for j in range(n) if mask >> j & 1 and norms[j] > 0]
        if len(free) != bin(mask).count("1"):
            continue
        y = _solve([[gram[i][j] for j in free] for i in free], [rhs[i] for i in free])
        if y is None or min(y) < 0:
            continue
        x = [0.0] * n
        for k, j in enumerate(free):
            x[j] = y[k] / norms[j]
        res = _residual(rows, x, target)
        if mask == full:
            return x, res
        if res < best_res:
            best, best_res = x, res
    return best, best_res


def _residual(rows: Sequence[Sequence[float]], x: list[float], target: Sequence[float]) -> float:
    return math.sqrt(math.fsum((dot(r, x) - t) ** 2 for r, t in zip(rows, target, strict=True)))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small system; None when it is singular."""
    k = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(k):
        p = max(range(c, k), key=lambda i: abs(m[i][c]))
        if abs(m[p][c]) < _SINGULAR:
            return None
        m[c], m[p] = m[p], m[c]
        for i in range(c + 1, k):
            f = m[i][c] / m[c][c]
            m[i] = [v - f * w for v, w in zip(m[i], m[c], strict=True)]
    y = [0.0] * k
    for i in reversed(range(k)):
        y[i] = (m[i][k] - math.fsum(m[i][j] * y[j] for j in range(i + 1, k))) / m[i][i]
    return y


__all__ = ["dot", "nnls"]
