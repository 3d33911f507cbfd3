"""Stage 2's one-node probe (probe.py) and the resize of starved nodes (resize_rules.py), on the policy.

A communication-bound job whose user asked for too many nodes runs several times faster on one node
(no collectives there), which no size of two or more shows; a compute-bound job never pays for a probe;
a probe that measures a loss goes back to the request once and is never tried again."""

from __future__ import annotations

from dataclasses import replace

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, RoundView
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import PlannerState

from .helpers import JOB, node

CFG = PlannerConfig(
    sample_interval_s=10, profile_window_s=30, min_profile_samples=2, cooldown_s=60, round_warmup_s=0
)


def _snapshot(now, members, waiting, number, step_of, job, cpu_util=0.3, cores=16):
    w = len(members)
    t = step_of(w)
    views = []
    for i, m in enumerate(members):
        v = node(m, i, busy=t, tp=job["global_batch"] / t / w)
        views.append(replace(v, cpu_count=cores, metrics=replace(v.metrics, cpu_util=cpu_util)))
    views += [node(n, 100 + i, seen_at=0.0) for i, n in enumerate(waiting)]
    return ClusterSnapshot(now, 1, 8, 5.0, tuple(views), RoundView(number, tuple(members)), job)


def _run(step_of, job, request, cfg=CFG, ticks=200):
    """The job from its request for `ticks` samples; the decisions it took (size, reason)."""
    pool = [f"n{i}" for i in range(8)]
    members, number = pool[:request], 0
    p, state, decided = PlannerPolicy(cfg), PlannerState(), []
    for i in range(ticks):
        waiting = [n for n in pool if n not in members]
        answer, state = p.step(_snapshot(10.0 * (i + 1), members, waiting, number, step_of, job), state)
        if isinstance(answer, Decision) and answer.members:
            members, number = list(answer.members), number + 1
            decided.append((len(members), answer.reason))
    return decided


COMM_BOUND = {**JOB, "bandwidth": 2e8, "request": {**JOB["request"], "nodes": 4}}


def test_a_communication_bound_job_is_probed_on_one_node_and_stays_there():
    def step_of(w: int) -> float:  # collectives at 2.5x wire speed on 2+ nodes; none on one
        return 2e-6 * 8192 / w + (0.17 if w > 1 else 0.0) + 0.005

    decided = _run(step_of, COMM_BOUND, 4)
    probes = [i for i, (w, why) in enumerate(decided) if "probe" in why]
    assert len(probes) == 1 and decided[probes[0]][0] == 1, decided
    # the prior (collectives at wire speed) may first try more nodes; measured faster, one node stays
    assert probes[0] <= 1 and [w for w, _ in decided[probes[0] :]] == [1], decided


def test_a_probe_that_measures_a_loss_goes_back_to_the_request_once_and_is_not_tried_again():
    def step_of(w: int) -> float:  # the step is mostly a fixed cost the model takes for collectives
        return 0.15 + 0.04 / w

    decided = _run(step_of, COMM_BOUND, 4, ticks=300)
    sizes = [w for w, _ in decided]
    assert sizes[:2] == [1, 4] and "probe" in decided[0][1], decided
    assert sizes.count(1) == 1, decided


def test_a_compute_bound_job_is_never_probed():
    def step_of(w: int) -> float:
        return 2e-5 * 8192 / w + 0.02 * (w - 1) / w + 0.005

    assert not any(
        "probe" in why for _, why in _run(step_of, {**JOB, "request": {**JOB["request"], "nodes": 4}}, 4)
    )


def test_the_probe_can_be_turned_off():
    def step_of(w: int) -> float:
        return 2e-6 * 8192 / w + (0.17 if w > 1 else 0.0) + 0.005

    assert not any(
        "probe" in why for _, why in _run(step_of, COMM_BOUND, 4, replace(CFG, probe_one_node=False))
    )


def test_starved_nodes_get_cores_once_per_level():
    """A node that uses all its cores (an input pipeline short of them) is resized to 1.5x; when the
    cluster does not grant it (the same cores next time), the raise is not asked again at every cooldown."""
    cfg = replace(CFG, resize_rounds=True)
    job = {**JOB, "request": {**JOB["request"], "nodes": 2}}
    members, p, state, decided = ["a", "b"], PlannerPolicy(cfg), PlannerState(), []
    for i in range(120):
        snap = _snapshot(
            10.0 * (i + 1), members, [], len(decided), lambda w: 0.1, job, cpu_util=0.99, cores=8
        )
        answer, state = p.step(snap, state)
        if isinstance(answer, Decision):
            decided.append(answer)
    resizes = [d for d in decided if "resize" in d.reason]
    assert len(resizes) == 1 and resizes[0].members == ("a", "b"), [d.reason for d in decided]
    assert "starved nodes get cores" in resizes[0].reason and state.advice.cpu_per_node >= 12
