"""What a round costs a job beyond its downtime: a slow warm-up, learnt from the run's own rounds
(state.drop_warmup), is neither read as a size's rate nor left out of the round's cost. docs/planner.md,
"Warm-ups and trends" and "The promise"."""

from __future__ import annotations

from dataclasses import replace

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, RoundView
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.promise import round_cost
from elastic_rm.planner.state import ConfigSample, PlannerState, drop_warmup

from . import helpers
from .helpers import JOB, node

CFG = PlannerConfig(
    sample_interval_s=10, profile_window_s=30, min_profile_samples=2, cooldown_s=60, round_warmup_s=0
)


def _run(warm_s: float, steps: int = 120, request: int = 2, downtime_s: float = 5.0):
    """The planner on a job whose step time follows helpers.step_s, every round's first ``warm_s`` seconds
    (after its members step again) at half speed. Returns [(time, size, reason)] and the state."""
    job = {**JOB, "request": {**JOB["request"], "nodes": request}}
    pool = [f"n{i}" for i in range(8)]
    members, number, decided_at = pool[:request], 0, 1.0
    p, state, rounds = PlannerPolicy(CFG), PlannerState(), []
    for i in range(steps):
        now = 10.0 * (i + 1)
        up = now >= decided_at + downtime_s
        t = helpers.step_s(len(members)) * (2.0 if now < decided_at + downtime_s + warm_s else 1.0)
        views = [
            node(m, k, busy=t if up else None, tp=job["global_batch"] / t / len(members) if up else 0.0)
            for k, m in enumerate(members)
        ]
        views += [node(n, 100 + k) for k, n in enumerate(x for x in pool if x not in members)]
        cur = RoundView(number, tuple(members), (), decided_at)
        answer, state = p.step(ClusterSnapshot(now, 1, 8, 5.0, tuple(views), cur, job, (), 0), state)
        if isinstance(answer, Decision) and answer.members:
            members, number, decided_at = list(answer.members), number + 1, now
            rounds.append((now, len(members), answer.reason))
    return rounds, state


def test_a_slow_warm_up_is_learnt_and_not_read_as_the_rate_of_a_size():
    """Every round's first 40 s run at half speed, longer than the profiling window. The first round shows
    it (its rate doubled after every earlier sample): those samples are dropped, later rounds are sampled
    only once warmed up, so no size is judged on its warm-up, and a round costs the training lost."""
    rounds, state = _run(warm_s=40.0)
    assert state.warmup_s >= 40.0 and state.warmup_loss_s > 0
    assert round_cost(CFG, state) == max(state.downtimes) + state.warmup_loss_s
    true = {w: helpers.step_s(w) for w in range(1, 9)}
    kept = [c for c in state.configs if c.clean]
    assert kept and all(c.step_s < 1.3 * true[c.world] for c in kept), kept  # no half-speed sample
    assert not any("stop-loss" in why for _, _, why in rounds), rounds


def test_a_steady_job_learns_no_warm_up_and_a_later_rise_is_the_data_not_a_warm_up():
    _, state = _run(warm_s=0.0)
    assert state.warmup_s == 0.0 and state.warmup_loss_s == 0.0
    slow = ConfigSample(50.0, 3, 2, 1.0, 0.2)
    late = replace(state, round_active_at=0.0, configs=(slow,))
    fast = ConfigSample(500.0, 3, 2, 1.0, 0.1)  # twice as fast 500 s into the round: the data changed
    assert drop_warmup(late, fast, 300.0) is late
    early = drop_warmup(late, replace(fast, t=200.0), 300.0)  # within 300 s: a warm-up, dropped
    assert early.configs == () and early.warmup_s == 200.0 and early.warmup_loss_s == 100.0
