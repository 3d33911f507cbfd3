import math

import numpy as np
import pytest

from elastic_rm.planner.perf_model import Sample, Shape, best_world, features, fit

SHAPE = Shape(batch=16384, emb_bytes_per_sample=26 * 64 * 4, dense_bytes=4e7, bandwidth=3.125e9)
TRUE = np.array([3e-6, 1.6, 1.3, 0.012])


def truth(w: int, cap: float = 1.0) -> float:
    return float(features(SHAPE, w, cap) @ TRUE)


def test_nnls_recovers_coefficients_from_distinct_configurations():
    samples = [Sample(w, c, truth(w, c)) for w in (1, 2, 4, 8, 16) for c in (1.0, 2.0)]
    f = fit(SHAPE, samples, prior=None, prior_weight=0.0)
    assert np.allclose(f.coef, TRUE, rtol=1e-6)
    assert f.r2 > 0.9999 and f.rel_rmse < 1e-6
    assert f.worlds == (1, 2, 4, 8, 16)


def test_coefficients_stay_non_negative_on_adversarial_data():
    # step time falling faster than any physical term: least squares would want a negative coefficient
    samples = [Sample(w, 1.0, 1.0 / w**2) for w in (1, 2, 3, 4)]
    f = fit(SHAPE, samples, prior_weight=0.0)
    assert all(c >= 0 for c in f.coef)
    assert f.rel_rmse > 0.01  # and the fit says it is poor


def test_single_configuration_uses_the_prior_and_matches_the_observation():
    f = fit(SHAPE, [Sample(4, 1.0, truth(4))] * 3)
    assert f.step_s(SHAPE, 4, 1.0) == pytest.approx(truth(4), rel=0.05)
    assert math.isnan(f.r2)  # undefined with one distinct point
    # prediction far away is uncertain: a wider band than at the observed size
    lo4, p4, hi4 = f.band(SHAPE, 4, 1.0)
    lo16, p16, hi16 = f.band(SHAPE, 16, 1.0)
    assert lo4 <= p4 <= hi4 and lo16 <= p16 <= hi16
    assert (hi16 - lo16) / p16 > (hi4 - lo4) / p4
    assert f.confidence(16) < f.confidence(4)


def test_noisy_fit_reports_residual_and_band_covers_truth():
    rng = np.random.default_rng(0)
    samples = [Sample(w, 1.0, truth(w) * rng.lognormal(0, 0.03)) for w in (2, 4, 8) for _ in range(4)]
    f = fit(SHAPE, samples)
    assert 0.005 < f.rel_rmse < 0.1
    for w in (2, 4, 8):
        lo, _, hi = f.band(SHAPE, w, 1.0)
        tp = SHAPE.batch / truth(w)
        assert lo <= tp <= hi


def test_best_world_follows_the_marginal_gain_rule():
    f = fit(SHAPE, [Sample(w, 1.0, truth(w)) for w in (1, 2, 4, 8, 16)], prior_weight=0.0)
    w, tp = best_world(f, SHAPE, 1.0, 1, 32, 0.2)
    tps = {k: SHAPE.batch / truth(k) for k in range(1, 33)}
    assert tps[w + 1] - tps[w] < 0.2 * tps[w] / w  # the next node would bring < 20% of an average node
    assert all(tps[k + 1] - tps[k] >= 0.2 * tps[k] / k for k in range(1, w))
    assert tp == pytest.approx(tps[w], rel=1e-6)
    assert best_world(f, SHAPE, 1.0, 1, 32, 0.0)[0] > w  # a lower bar admits more nodes
    assert best_world(f, SHAPE, 1.0, w + 2, 32, 0.2)[0] == w + 2  # never below lo


def test_observed_cap_vetoes_sizes_that_did_not_pay():
    from elastic_rm.planner.scaling import observed_cap

    # 4 -> 8 nodes: step 0.100 -> 0.093 s is +7.5% throughput: each added node brings 7.5% of an average one
    samples = [(4, 0.10), (4, 0.10), (8, 0.093), (8, 0.093)]
    assert observed_cap(samples, 0.2) == 4
    assert observed_cap(samples, 0.05) is None  # a lower bar accepts it
    # 2 -> 4 paid (+90%), 4 -> 8 did not: the cap is the last size that paid
    assert observed_cap([(2, 0.19), (2, 0.19), *samples], 0.2) == 4
    assert observed_cap([(4, 0.1), (8, 0.093)], 0.2) is None  # one sample per size is not a measurement
