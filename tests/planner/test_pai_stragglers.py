"""The straggler detector on real per-worker mini-batch times (four 10-worker jobs on Alibaba's PAI,
benchmarks/planner/data/): what it flags is a documented choice (docs/planner.md, "Stragglers")."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.planner.pai_stragglers import analyse
from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.runtime import reference_busy, update_stragglers
from elastic_rm.planner.state import NodeSample, PlannerState

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
    # two nodes: the faster one's (their median is their mean: a node would be slow only past 3x the other)
    assert reference_busy([1.0, 3.0], 1.5) == 1.0
    assert reference_busy([2.0, 1.0], 1.5) == 1.0


def _flags(busy_rounds: list[dict[str, float]], cfg: PlannerConfig = CFG) -> dict[int, frozenset[str]]:
    """Feed per-member busy times, one sample per second, through the detector; flagged set per second."""
    state, out = PlannerState(round_active_at=0.0), {}
    for t, busy in enumerate(busy_rounds, start=1):
        nodes = {m: (NodeSample(float(t), b, 1.0, 0.0, 1.0, 1.0, -1.0, False),) for m, b in busy.items()}
        state = replace(state, nodes=nodes)
        slow, flagged = update_stragglers(state, tuple(busy), float(t), cfg)
        state = replace(state, slow=slow, flagged=flagged)
        out[t] = flagged
    return out


def test_a_whole_world_slowing_down_blames_no_node():
    """Straggler attribution: when every member slows down alike (a busier machine, a slower network),
    nobody is flagged, also not the node that was the slowest before; busy time is each node's own."""
    members = [f"n{i}" for i in range(5)]
    base = {m: 1.0 + 0.1 * i for i, m in enumerate(members)}  # n4 the slowest, 1.4x n0
    rounds = [base] * 5 + [{m: 3.0 * b for m, b in base.items()} for _ in range(10)]
    assert all(not f for f in _flags(rounds).values())
    two = [{"a": 1.0, "b": 1.3}] * 5 + [{"a": 4.0, "b": 5.2}] * 10  # a world of two, likewise
    assert all(not f for f in _flags(two).values())


def test_in_a_world_of_two_the_slow_node_is_blamed_never_its_partner():
    rounds = [{"a": 1.0, "b": 1.0}] * 3 + [{"a": 1.0, "b": 2.0}] * 5
    flags = _flags(rounds)
    assert flags[max(flags)] == {"b"}  # 2x its partner: flagged after straggler_enter samples
    assert all("a" not in f for f in flags.values())
    assert not any(_flags([{"a": 1.0, "b": 1.4}] * 8).values())  # under k = 1.5: a spread, not a straggler
