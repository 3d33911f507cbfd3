"""The straggler rule's floor: a node is slow only when its busy time exceeds the reference by k AND by a
share of the step time. A step spent mostly waiting (the emulated workload sleeps; real input pipelines
wait on I/O) has milliseconds of busy time, which a loaded machine doubles without the node being slower."""

from __future__ import annotations

from dataclasses import replace

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import StepStats
from elastic_rm.planner.runtime import update_stragglers
from elastic_rm.planner.state import NodeSample, PlannerState, observe
from tests.planner.helpers import running

CFG = PlannerConfig(round_warmup_s=0.0)
MEMBERS = ("a", "b", "c", "d")


def _flagged(busy: dict[str, float], step_s: float, cfg: PlannerConfig = CFG, samples: int = 8) -> set:
    """Feed the same per-member busy times (steps of ``step_s``) through the detector, one per second."""
    state = PlannerState(round_active_at=0.0)
    for t in range(1, samples + 1):
        nodes = {
            m: (NodeSample(float(t), b, 1.0, 0.0, 1.0, 1.0, -1.0, False, step_s),) for m, b in busy.items()
        }
        state = replace(state, nodes=nodes)
        slow, flagged = update_stragglers(state, tuple(busy), float(t), cfg)
        state = replace(state, slow=slow, flagged=flagged)
    return set(state.flagged)


def test_milliseconds_of_busy_time_on_a_one_second_step_are_noise():
    noisy = {"a": 0.004, "b": 0.004, "c": 0.004, "d": 0.007}  # 1.75x the reference, 3 ms of a 1 s step
    assert _flagged(noisy, 1.0) == set()
    assert _flagged(noisy, 1.0, replace(CFG, straggler_min_share=0.0)) == {"d"}  # the rule without floor


def test_a_real_straggler_is_still_flagged():
    assert _flagged({"a": 0.4, "b": 0.4, "c": 0.4, "d": 0.9}, 1.0) == {"d"}  # half the step more busy
    # on a step of pure compute (busy = step time, or an agent that reports no busy time) the floor
    # never binds: k x the reference is past it
    assert _flagged({"a": 1.0, "b": 1.0, "c": 1.0, "d": 1.6}, 0.0) == {"d"}


def test_a_flagged_node_whose_gap_falls_under_the_floor_is_cleared():
    state = PlannerState(round_active_at=0.0)
    t = 0
    for busy in [{"a": 0.4, "b": 0.4, "c": 0.4, "d": 0.9}] * 3 + [
        {"a": 0.004, "b": 0.004, "c": 0.004, "d": 0.007}
    ] * 3:
        t += 1
        nodes = {m: (NodeSample(float(t), b, 1.0, 0.0, 1.0, 1.0, -1.0, False, 1.0),) for m, b in busy.items()}
        state = replace(state, nodes=nodes)
        slow, flagged = update_stragglers(state, MEMBERS, float(t), CFG)
        state = replace(state, slow=slow, flagged=flagged)
        if t == 3:
            assert flagged == {"d"}
    assert state.flagged == frozenset()


def _sample_clean(busy: dict[str, float], cfg: PlannerConfig) -> bool:
    """Whether the job-level sample taken from a snapshot with these busy times (1 s steps) is clean."""
    snap = running(100.0, list(busy))
    views = tuple(
        replace(v, metrics=replace(v.metrics, steps=StepStats(1.0, 1.05, 100.0, 100, busy[v.node_id])))
        for v in snap.nodes
    )
    snap = replace(snap, nodes=views)
    state = observe(
        snap, PlannerState(), 1.0, 6, cfg.straggler_k, 0.0, straggler_min_share=cfg.straggler_min_share
    )
    state = observe(
        replace(snap, now=102.0),
        state,
        1.0,
        6,
        cfg.straggler_k,
        0.0,
        straggler_min_share=cfg.straggler_min_share,
    )
    assert state.configs, "a job-level sample was recorded"
    return state.configs[-1].clean


def test_the_job_level_sample_is_judged_by_the_same_floor():
    noisy = {"a": 0.004, "b": 0.004, "c": 0.004, "d": 0.007}
    assert _sample_clean(noisy, CFG)
    assert not _sample_clean(noisy, replace(CFG, straggler_min_share=0.0))
    assert not _sample_clean({"a": 0.4, "b": 0.4, "c": 0.4, "d": 0.9}, CFG)
