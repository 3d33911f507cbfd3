"""The straggler detector on real per-worker mini-batch times (four 10-worker jobs on Alibaba's PAI,
benchmarks/planner/data/): what it flags is a documented choice (docs/planner.md, "Stragglers")."""

from __future__ import annotations

from benchmarks.planner.pai_stragglers import analyse
from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.runtime import reference_busy

CFG = PlannerConfig(round_warmup_s=0.0)


def test_the_transient_episode_of_job_1_is_flagged_after_three_samples_and_nothing_else():
    r = analyse(1, CFG, 3.0, 0.1)
    assert r["flagged_first_at"] == {"worker6": 1831}  # slow from iteration 1811: 3 consecutive samples
    assert r["false_positive_share"] == 0.0 and r["replacements"] == 1


def test_a_stable_spread_and_a_late_drift_below_k_are_left_alone():
    assert analyse(2, CFG, 3.0, 0.1)["flagged_samples"] == {}  # job 2: steady, up to 1.09x the median
    assert analyse(3, CFG, 3.0, 0.1)["flagged_samples"] == {}  # job 3: late drift, up to ~1.3x


def test_a_slower_class_is_not_a_straggler_but_a_node_far_slower_than_its_class_is():
    r = analyse(4, CFG, 3.0, 0.1)
    # five workers run ~4x slower than the other five for the whole job: without the class rule every
    # one of them would be flagged at once; with it, the late 6x episode of workers 5 and 6 is
    assert {"worker5", "worker6"} <= set(r["flagged_first_at"])
    assert r["flagged_first_at"]["worker5"] > 18000 and r["flagged_first_at"]["worker6"] > 18000
    assert "worker8" not in r["flagged_first_at"]
    assert sum(r["flagged_samples"].values()) < 0.05 * r["samples"] * 10


def test_reference_busy():
    assert reference_busy([1.0, 1.0, 1.0, 3.0], 1.5) == 1.0  # one straggler of four: the median
    assert reference_busy([1.0, 1.0, 4.0, 4.0], 1.5) == 4.0  # a class of two: the slower half's median
    assert reference_busy([1.0, 3.0], 1.5) == 2.0  # two nodes: the median (one slow node is a straggler)
