"""The planner's NNLS: as good as scipy's, non-negative, and the same to the last bit whatever BLAS kernels
the machine runs (scipy's is not: its results moved in the last bits between OpenBLAS's CPU kernels, and
the simulated cluster grew those bits into different decisions)."""

import os
import platform
import subprocess
import sys

import numpy as np
import pytest
from scipy.optimize import nnls as scipy_nnls

from elastic_rm.planner.nnls import dot, nnls


def test_as_good_as_scipy_on_random_problems():
    rng = np.random.default_rng(0)
    for _ in range(500):
        rows, cols = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        a = rng.lognormal(0, 3, (rows, cols)) * (rng.random((rows, cols)) < 0.9)
        b = rng.normal(0, 1, rows) + a @ rng.normal(0, 1, cols)
        ref, ref_res = scipy_nnls(a, b)
        x, res = nnls(a.tolist(), b.tolist())
        assert min(x) >= 0
        assert res <= ref_res + 1e-9 * max(float(np.linalg.norm(b)), 1.0)
        assert res == pytest.approx(float(np.linalg.norm(a @ np.array(x) - b)), rel=1e-9, abs=1e-12)
        if rows > cols + 2 and np.linalg.cond(a) < 1e8:  # a unique optimum: the same coefficients
            assert np.allclose(x, ref, rtol=1e-8, atol=1e-10 * max(float(np.max(np.abs(ref))), 1e-12))


def test_a_term_least_squares_would_make_negative_is_zero():
    # y = 2 * x0 - 1 * x1 would fit exactly; the best non-negative fit drops x1 and refits x0 alone
    rows = [[1.0, 1.0], [2.0, 1.0], [3.0, 1.0], [4.0, 1.0]]
    target = [2.0 * r[0] - 1.0 for r in rows]
    x, res = nnls(rows, target)
    assert x[1] == 0.0
    assert x[0] == pytest.approx(dot([1, 2, 3, 4], target) / dot([1, 2, 3, 4], [1, 2, 3, 4]))
    assert res > 0


def test_exact_data_is_recovered_and_a_zero_column_gets_zero():
    rows = [[w, 1.0 / w, 0.0] for w in (1.0, 2.0, 4.0, 8.0)]
    target = [3.0 * r[0] + 0.5 * r[1] for r in rows]
    x, res = nnls(rows, target)
    assert x == pytest.approx([3.0, 0.5, 0.0], abs=1e-12)
    assert res < 1e-12


def test_bad_shapes_say_what_is_wrong():
    with pytest.raises(ValueError, match="one target per row"):
        nnls([[1.0, 2.0]], [1.0, 2.0])
    with pytest.raises(ValueError, match="columns"):
        nnls([[1.0] * 7], [1.0])
    with pytest.raises(ValueError, match="dot of 2 and 3"):
        dot([1.0, 2.0], [1.0, 2.0, 3.0])


FITS = """
import hashlib, random
from elastic_rm.planner.baselines import optimus_fit
from elastic_rm.planner.perf_model import Sample, Shape, fit
rng, out = random.Random(7), []
for _ in range(300):
    shape = Shape(rng.choice([8192.0, 65536.0]), rng.uniform(1e3, 1e5), rng.uniform(1e6, 1e8),
                  rng.choice([1.25e9, 12.5e9]))
    samples = [Sample(w, rng.choice([1.0, 2.0, 4.0]), rng.uniform(0.05, 2.0))
               for w in rng.choices(range(1, 33), k=rng.randint(1, 24))]
    f = fit(shape, samples)
    opt = optimus_fit([(s.world, s.step_s) for s in samples], shape.batch)
    out.append(repr((f.coef, f.r2, f.rel_rmse, opt)))
print(hashlib.sha256("\\n".join(out).encode()).hexdigest())
"""


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="OpenBLAS core types are x86 names")
def test_fits_are_the_same_to_the_last_bit_with_other_blas_kernels():
    """300 fits of the planner's model and of Optimus-style's, with OpenBLAS forced to its AVX2 (Haswell)
    and its AVX (Sandybridge) kernels: the same bits (with scipy's nnls and numpy's @, they differed)."""
    digests = set()
    for core in ("Haswell", "Sandybridge"):
        env = {**os.environ, "OPENBLAS_CORETYPE": core}
        run = subprocess.run(
            [sys.executable, "-c", FITS], env=env, capture_output=True, text=True, timeout=120
        )
        assert run.returncode == 0, run.stderr
        digests.add(run.stdout.strip())
    assert len(digests) == 1
