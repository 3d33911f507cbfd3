"""Nodes lent past the request (lending.py, docs/planner.md "The cluster's queue"): a job that grew past
its user's request while nobody waited gives those nodes back at the first decision that sees waiting
demand, inside its cooldown, never below its request and at most as many as wait; nodes that clear the
queued bar stay."""

from __future__ import annotations

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, RoundView
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import PlannerState

from .helpers import JOB, node

CFG = PlannerConfig(
    sample_interval_s=10, profile_window_s=30, min_profile_samples=2, cooldown_s=600, round_warmup_s=0
)


def linear_step(world: int) -> float:
    """A job whose compute divides over the nodes and a fixed part does not: every added node brings more
    than the lent bar (20% of an average node) and less than the queued one (75%)."""
    return 1e-4 * 8192 / world + 0.1


def _run(waiting_of, steps: int = 150, request: int = 2, cfg: PlannerConfig = CFG, step_of=None):
    """The planner on ``step_of`` (``linear_step``) with ``waiting_of(now)`` nodes wanted by queued jobs;
    returns the rounds [(time, size, reason)]."""
    job = {**JOB, "request": {**JOB["request"], "nodes": request}}
    pool = [f"n{i}" for i in range(8)]
    members, number, decided_at = pool[:request], 0, 1.0
    p, state, rounds = PlannerPolicy(cfg), PlannerState(), []
    for i in range(steps):
        now = 10.0 * (i + 1)
        t = (step_of or linear_step)(len(members))
        views = [node(m, k, busy=t, tp=8192 / t / len(members)) for k, m in enumerate(members)]
        views += [node(n, 100 + k) for k, n in enumerate(x for x in pool if x not in members)]
        cur = RoundView(number, tuple(members), (), decided_at)
        snap = ClusterSnapshot(now, 1, 8, 5.0, tuple(views), cur, job, (), waiting_of(now))
        answer, state = p.step(snap, state)
        if isinstance(answer, Decision) and answer.members:
            members, number, decided_at = list(answer.members), number + 1, now
            rounds.append((now, len(members), answer.reason))
    return rounds


def test_lent_nodes_are_given_back_at_the_first_decision_that_sees_a_queue():
    grown = _run(lambda now: 0)
    assert grown and max(w for _, w, _ in grown) > 2, grown  # nobody waits: it grows past its request
    t_up = next(t for t, w, _ in grown if w > 2)
    queue_at = t_up + 20.0  # a job arrives well inside the cooldown of the scale-up
    rounds = _run(lambda now: 3 if now >= queue_at else 0)
    back = [(t, w, why) for t, w, why in rounds if t >= queue_at]
    assert back, rounds
    t_back, w_back, why = back[0]
    assert t_back == queue_at and "given back at once" in why, rounds  # inside the cooldown, at once
    size_before = [w for t, w, _ in rounds if t < queue_at][-1]
    assert w_back == max(2, size_before - 3), rounds  # at most the waiting nodes, never below the request


def test_a_single_waiting_node_takes_back_only_one():
    grown = _run(lambda now: 0)
    t_up, w_up = next((t, w) for t, w, _ in grown if w > 3)
    rounds = _run(lambda now: 1 if now >= t_up + 20.0 else 0)
    back = [w for t, w, _ in rounds if t >= t_up + 20.0]
    assert back and back[0] == w_up - 1, rounds


def test_nodes_that_clear_the_queued_bar_stay():
    def scales(world: int) -> float:  # compute that divides almost perfectly: every node brings ~100%
        return 1e-4 * 8192 / world + 0.001

    rounds = _run(lambda now: 5, step_of=scales)
    assert rounds and max(w for _, w, _ in rounds) > 2, rounds  # grown past its request of 2
    assert not any("given back" in why for _, _, why in rounds), rounds
