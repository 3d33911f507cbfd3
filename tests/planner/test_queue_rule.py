"""The cluster's queue (``ClusterSnapshot.waiting_nodes``, docs/planner.md "The cluster's queue"): while
other jobs wait for nodes, a node past the user's request must bring ``queued_node_gain`` of an average
node, lent nodes below that bar are given back (at most as many as wait), and a warm start past the
request keeps only such nodes; when nothing waits (or nothing is known) the rule is today's."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.history import parse_record, warm_start
from elastic_rm.planner.interface import Decision
from elastic_rm.planner.job import parse_job
from elastic_rm.planner.perf_model import Fit, best_world
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.scaling import choose_world, shape_of, user_floor
from elastic_rm.planner.state import PlannerState

from .helpers import JOB, running
from .test_history import rec

CFG = PlannerConfig()
BAR = CFG.queued_node_gain
coefs = st.tuples(st.floats(1e-7, 1e-4), st.floats(0.0, 1.0), st.floats(0.0, 1.0), st.floats(1e-4, 0.05))


def _job(request: int):
    return parse_job({**JOB, "request": {**JOB["request"], "nodes": request}})


@settings(max_examples=300, deadline=None)
@given(coefs, st.integers(1, 8), st.integers(0, 8), st.integers(1, 12))
def test_with_demand_waiting_nodes_past_the_request_bring_the_queued_bar(coef, request, extra, waiting):
    """Waiting demand: the world chosen past the request is one whose nodes clear the queued bar from the
    request (best_world at BAR), or a give-back of at most ``waiting`` nodes; never below the request."""
    job = _job(request)
    f = Fit(coef, float("nan"), 0.0, 1, (request,))
    current = request + extra
    t = choose_world(f, job, 1.0, current, 1, 16, CFG, request=request, waiting=waiting)
    worth = best_world(f, shape_of(job), 1.0, request, 16, BAR)[0]
    if t.world > request:
        assert t.world <= max(worth, current - waiting), (t.world, worth, t.why)
    if "queued jobs" in t.why:
        assert max(request, current - waiting) <= t.world < current, t.why
        assert worth < current


@settings(max_examples=300, deadline=None)
@given(coefs, st.integers(1, 8), st.integers(0, 8), st.integers(1, 12))
def test_without_demand_waiting_the_rule_is_unchanged(coef, request, current, waiting):
    """Nothing waits (0, or None: the leader knows nothing) and the queue was not seen recently: the
    choice is exactly the one without a queued bar, which growth past the request still gets."""
    job = _job(request)
    f = Fit(coef, float("nan"), 0.0, 1, (request,))
    cur = max(current, 1)
    plain = choose_world(f, job, 1.0, cur, 1, 16, replace(CFG, queued_node_gain=0.0), request=request)
    assert choose_world(f, job, 1.0, cur, 1, 16, CFG, request=request, waiting=0, queues=False) == plain
    off = replace(CFG, queued_node_gain=0.0)  # the bar off: demand waiting changes nothing either
    assert choose_world(f, job, 1.0, cur, 1, 16, off, request=request, waiting=waiting) == plain


def test_growth_past_the_request_is_chosen_only_when_nothing_waits_and_lent_nodes_go_back():
    job = _job(2)
    f = Fit((2e-6, 0.3, 0.3, 0.01), float("nan"), 0.0, 1, (2,))  # nodes 3..5 bring 30%..21% each
    assert choose_world(f, job, 1.0, 2, 1, 8, CFG, request=2).world == 5  # nobody waits: grow
    assert choose_world(f, job, 1.0, 2, 1, 8, CFG, request=2, waiting=3).world == 2  # demand waits
    assert choose_world(f, job, 1.0, 2, 1, 8, CFG, request=2, queues=True).world == 2  # it queued lately
    back = choose_world(f, job, 1.0, 5, 1, 8, CFG, request=2, waiting=3)
    assert back.world == 2 and "3 node(s) wanted by queued jobs" in back.why
    assert choose_world(f, job, 1.0, 5, 1, 8, CFG, request=2, waiting=1).world == 4  # one waits: one back
    assert choose_world(f, job, 1.0, 5, 1, 8, CFG, request=2).world == 5  # nobody waits: keep them


def _run(waiting: int | None) -> list[tuple[float, int, str]]:
    """A job of request 2 on 8 nodes for an hour; nobody waits until 15 minutes after it first grew past
    its request, then ``waiting`` is in every snapshot. The (time, world, reason) of its decisions."""
    p, state, out = PlannerPolicy(), PlannerState(), []
    pool = list("abcdefgh")
    members, number, decided, grown = pool[:2], 0, 0.0, None
    for i in range(120):
        now = 30.0 * (i + 1)
        queue = waiting if grown is not None and now > grown + 900 else None
        extra = [n for n in pool if n not in members]
        snap = replace(running(now, members, extra, number, decided), waiting_nodes=queue)
        answer, state = p.step(snap, state)
        if isinstance(answer, Decision):
            members, number, decided = list(answer.members), number + 1, now
            out.append((now, len(members), answer.reason))
            grown = now if grown is None and len(members) > 2 else grown
    return out


def test_the_policy_gives_lent_nodes_back_while_demand_waits_and_keeps_them_otherwise():
    plain = _run(None)
    assert plain and plain[0][1] > 2, plain  # nobody waits: it grows past its request of 2
    assert _run(0) == plain  # 0 (known: nobody waits) is None's behaviour (unknown): today's rule
    assert not any("queued" in why for _, _, why in plain)
    waited = _run(4)
    assert waited[0] == plain[0]
    back = [(t, w, why) for t, w, why in waited if "wanted by queued jobs" in why]
    assert back, waited  # the lent nodes go back to the queue ...
    for (_, before, _), (_, w, why) in zip(waited, waited[1:], strict=False):
        assert w >= 2, waited  # ... never below the request ...
        if "wanted by queued jobs" in why:
            assert before - 4 <= w < before, waited  # ... at most as many as wait
        elif w > before:
            assert f"{BAR:.0%}" in why, waited  # growth while demand waits clears the queued bar


def test_a_warm_start_past_the_request_keeps_only_what_clears_the_queued_bar_while_demand_waits():
    job = _job(2)
    coef = [2e-6, 0.3, 0.3, 0.01]  # nodes 3..5 bring 30%..21% each on this model
    records = [parse_record(rec(f"r{i}", 5, t=i, coef=coef)) for i in range(3)]
    assert warm_start(job, records, 1, 8, CFG).world == 5  # nobody waits: the size past runs ended at
    plan = warm_start(job, records, 1, 8, CFG, waiting=6)
    assert plan.world == 2 and "wanted by queued jobs" in plan.reason
    linear = [parse_record(rec(f"r{i}", 5, t=i, coef=[1e-4, 0.0, 0.0, 0.0])) for i in range(3)]
    assert warm_start(job, linear, 1, 8, CFG, waiting=6).world == 5  # nodes that pay in full are kept
    no_model = [parse_record(rec(f"r{i}", 5, t=i)) for i in range(3)]
    assert warm_start(job, no_model, 1, 8, CFG, waiting=6).world == 2  # no model: the request


@settings(max_examples=300, deadline=None)
@given(coefs, st.integers(2, 10), st.integers(0, 6), st.integers(0, 12), st.integers(-4, 4))
def test_while_the_cluster_queues_nodes_past_the_users_floor_bring_the_queued_bar(
    coef, request, below, waiting, extra
):
    """With the user's floor below the request (fewer nodes within user_loss_max of its throughput): while
    demand waits, nodes past the floor below the queued bar are given back, at most ``waiting`` of them and
    never below the floor; while the cluster queues, growth stops where nodes past the floor stop clearing
    the bar. The job never goes below the floor, so never below the user's rule."""
    job = _job(request)
    f = Fit(coef, float("nan"), 0.0, 1, (request,))
    floor, current = max(request - below, 1), max(request + extra, 1)
    t = choose_world(f, job, 1.0, current, 1, 16, CFG, None, floor, "user", request, waiting, True)
    queued = best_world(f, shape_of(job), 1.0, floor, 16, BAR)[0]
    assert t.world >= floor, t.why
    if t.world > current:
        assert t.world <= max(queued, current), (t.world, queued, t.why)
    if "past the user's floor" in t.why:  # a round moves at most max_step nodes
        back = max(queued, current - waiting, current - CFG.max_step)
        assert waiting > 0 and t.world == back < current, (t.world, queued, t.why)


def test_demand_takes_a_job_down_to_the_users_floor_and_a_recent_queue_stops_its_growth_there():
    """Two jobs of the model's own form, collectives included (found by a search over coefficients)."""
    job = _job(8)  # its 8th node brings less than 3% of the request's throughput: the floor is 7
    f = Fit((4.57e-6, 0.751, 0.888, 0.0129), float("nan"), 0.0, 1, (8,))
    floor = user_floor(f, job, 1.0, 8, 1, CFG.user_loss_max, [])[0]
    assert floor == 7
    t = choose_world(f, job, 1.0, 9, 1, 16, CFG, None, floor, "user", 8, 2, True)
    assert t.world == 7 and "past the user's floor of 7" in t.why, t
    without = choose_world(f, job, 1.0, 9, 1, 16, CFG, None, 0, "", 8, 2, True)
    assert without.world == 8, without  # the lent-node rule alone stops at the request
    job = _job(9)  # started short at 5 nodes; its floor is 8
    f = Fit((1.10e-5, 0.673, 0.839, 0.0317), float("nan"), 0.0, 1, (9,))
    floor = user_floor(f, job, 1.0, 9, 1, CFG.user_loss_max, [])[0]
    assert floor == 8
    quiet = choose_world(f, job, 1.0, 5, 1, 16, CFG, None, floor, "user", 9, 0, False)
    queued = choose_world(f, job, 1.0, 5, 1, 16, CFG, None, floor, "user", 9, 0, True)
    assert quiet.world >= 9 and queued.world == 8 and "the cluster queues" in queued.why, (quiet, queued)
