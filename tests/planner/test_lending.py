"""Nodes lent past the request (lending.py, docs/planner.md "The cluster's queue"): a job that grew past
its user's request while nobody waited gives those nodes back at the first decision that sees waiting
demand, inside its cooldown, never below its request and at most as many as wait; nodes that clear the
queued bar stay."""

from __future__ import annotations

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, RoundView
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import Advice, PlannerState

from .helpers import JOB, node

CFG = PlannerConfig(
    sample_interval_s=10, profile_window_s=30, min_profile_samples=2, cooldown_s=600, round_warmup_s=0
)


def linear_step(world: int) -> float:
    """A job whose compute divides over the nodes and a fixed part does not: every added node brings more
    than the lent bar (20% of an average node) and less than the queued one (75%)."""
    return 1e-4 * 8192 / world + 0.1


def _run(waiting_of, steps: int = 150, request: int = 2, cfg: PlannerConfig = CFG, step_of=None, log=None):
    """The planner on ``step_of`` (``linear_step``) with ``waiting_of(now)`` nodes wanted by queued jobs;
    returns the rounds [(time, size, reason)]; ``log`` (a list) also gets every (time, Decision)."""
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
        if isinstance(answer, Decision) and log is not None:
            log.append((now, answer))
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


def test_one_waiting_job_is_answered_once_while_it_still_waits():
    """The queue key stays up until the waiting job starts: the nodes already given back answer it, so the
    run stays at its size after the give-back for every later decision, not one node less each time."""
    grown = _run(lambda now: 0)
    t_up, w_up = next((t, w) for t, w, _ in grown if w > 3)
    queue_at = t_up + 20.0
    rounds = _run(lambda now: 1 if now >= queue_at else 0)
    after = [(t, w) for t, w, _ in rounds if t >= queue_at]
    assert after and after[0] == (queue_at, w_up - 1), rounds
    assert all(w == w_up - 1 for _, w in after), rounds  # the whole chain: constant after the give-back
    assert rounds[-1][0] < 10.0 * 150, rounds


def test_given_back_nodes_are_not_the_rounds_standby():
    """A launcher that keeps every member and standby node (the Slurm one) frees only nodes outside both:
    a node given back must be in neither, or the waiting job never gets it."""
    grown = _run(lambda now: 0)
    t_up = next(t for t, w, _ in grown if w > 3)
    log = []
    _run(lambda now: 1 if now >= t_up + 20.0 else 0, log=log)
    before = [d for t, d in log if t < t_up + 20.0][-1]
    back = next(d for t, d in log if "given back" in d.reason)
    gone = set(before.members) - set(back.members)
    assert len(gone) == 1 and len(back.members) == len(before.members) - 1, (before, back)
    assert not gone & set(back.standby), (before, back)  # members | standby: what the launcher keeps
    assert set(back.standby) <= set(before.standby), (before, back)  # from the nodes that were not members


def _at_four(mem_gib: float, measured: tuple[str, ...], fit_nodes: int = 0):
    """The lending rule on a run of 4 (request 2) with 2 nodes wanted: ``measured`` members have a sample
    at ``mem_gib`` of 64 GiB; the others joined the round and have not reported yet."""
    from elastic_rm.planner.job import parse_job
    from elastic_rm.planner.lending import reclaim_check
    from elastic_rm.planner.state import NodeSample

    members = ("n0", "n1", "n2", "n3")
    gib = 2**30
    views = tuple(node(m, k, mem_gib=mem_gib) for k, m in enumerate(members)) + (node("n4", 9),)
    sample = NodeSample(5.0, 0.1, 100.0, mem_gib * gib, 64.0 * gib, 4.0, 0.8, False)
    state = PlannerState(nodes={m: (sample,) for m in measured}, fit_nodes=fit_nodes)
    snap = ClusterSnapshot(10.0, 1, 8, 5.0, views, RoundView(1, members, (), 1.0), JOB, (), 2)
    return reclaim_check(CFG, snap, state, parse_job(JOB), members, ["n4"], list(views), None)


def test_the_memory_floor_holds_while_new_members_have_not_reported():
    """The memory rule grew the run to 4 (the memory needs them); a queue forms before the two new nodes
    report: the measured members' memory stands for them, and nothing is given back below the floor."""
    measured = ("n0", "n1", "n2", "n3")
    answer, _ = _at_four(55.0, measured)
    assert answer is None  # all measured: the memory floor keeps the 4
    answer, _ = _at_four(55.0, measured[:2])
    assert answer is None, answer
    answer, _ = _at_four(55.0, ())
    assert answer is None, answer  # nobody measured: the floor is unknown, nothing is given back
    answer, _ = _at_four(8.0, measured[:2])
    assert isinstance(answer, Decision) and len(answer.members) == 2, answer  # little memory: given back


def test_nothing_is_given_back_below_the_size_an_oom_showed_the_memory_fits_on():
    answer, _ = _at_four(8.0, ("n0", "n1", "n2", "n3"), fit_nodes=4)
    assert answer is None, answer
    answer, _ = _at_four(8.0, ("n0", "n1", "n2", "n3"), fit_nodes=3)
    assert isinstance(answer, Decision) and len(answer.members) == 3, answer


def test_given_back_nodes_answer_the_queue_until_its_count_falls():
    """Two nodes given back to a queue of 2: while it stays at 2 both answer it; when one waiting job
    starts (the count falls to 1) one was taken up and one still answers; an empty queue is owed none."""
    from elastic_rm.planner.lending import settle_loans

    state = PlannerState(given_back=2, given_back_for=2)
    assert settle_loans(state, 2) == state
    one = settle_loans(state, 1)
    assert (one.given_back, one.given_back_for) == (1, 1)
    more = settle_loans(one, 3)  # another job queued: the given-back node still answers part of it
    assert (more.given_back, more.given_back_for) == (1, 3)
    assert (settle_loans(more, 0).given_back, settle_loans(more, 0).given_back_for) == (0, 0)


def test_a_scale_up_that_does_not_repay_its_rounds_asks_for_no_nodes():
    """The advice (``wanted_nodes``) is what a launcher starts nodes for and what the simulator allocates:
    a move past the request that the planner will not make (it does not repay its rounds) must not ask for
    nodes, or they are held idle, neither members nor standby, while later arrivals queue behind them."""
    from dataclasses import replace

    job = {**JOB, "request": {**JOB["request"], "nodes": 2}}
    pool = [f"n{i}" for i in range(8)]
    for horizon, repays in ((CFG.gain_horizon_s, True), (1.0, False)):
        p = PlannerPolicy(replace(CFG, gain_horizon_s=horizon))
        members, wanted, decisions = pool[:2], [], []
        for i in range(150):
            t = linear_step(2)
            views = [node(m, k, busy=t, tp=8192 / t / 2) for k, m in enumerate(members)]
            views += [node(n, 100 + k) for k, n in enumerate(pool[2:])]
            cur = RoundView(0, tuple(members), (), 1.0)
            answer = p.decide(ClusterSnapshot(10.0 * (i + 1), 1, 8, 5.0, tuple(views), cur, job, (), 0))
            if isinstance(answer, Decision):
                decisions.append(answer)
                break
            wanted.append(p.wanted_nodes()[0])
        if repays:  # the move pays: the nodes are asked for and the scale-up is made
            assert decisions and len(decisions[0].members) > 2, decisions
        else:  # it never repays a round: no scale-up, and no node asked for it
            assert not decisions and wanted and max(wanted) == 2, (decisions, wanted)


def test_lent_nodes_go_back_where_rounds_resize_the_memory_the_smaller_run_needs():
    """A run lent 2 nodes past its request of 2 whose budgets were cut to its lent size (55 of 64 GiB per
    node in use): on 2 nodes it would not fit the nodes it has, so without resizable rounds the loan stays.
    Where rounds resize (the simulator), the give-back round carries the memory to the smaller run, up to
    what the user asked per node; with no more asked than the nodes hold, the loan stays."""
    from dataclasses import replace

    from elastic_rm.planner.job import parse_job
    from elastic_rm.planner.lending import reclaim_check
    from elastic_rm.planner.state import NodeSample

    gib = 2**30
    members = ("n0", "n1", "n2", "n3")
    views = tuple(node(m, k, mem_gib=55.0) for k, m in enumerate(members)) + (node("n4", 9),)
    sample = NodeSample(5.0, 0.1, 100.0, 55.0 * gib, 64.0 * gib, 4.0, 0.8, False)
    state = PlannerState(nodes={m: (sample,) for m in members}, advice=Advice(4, 6.0, 64.0 * gib, "x"))
    snap = ClusterSnapshot(10.0, 1, 8, 5.0, views, RoundView(1, members, (), 1.0), JOB, (), 2)

    def give_back(cfg, asked_gib):
        job = parse_job({**JOB, "request": {**JOB["request"], "mem_per_node_bytes": int(asked_gib * gib)}})
        return reclaim_check(cfg, snap, state, job, members, ["n4"], list(views), None)

    resizes = replace(CFG, resize_rounds=True)
    assert give_back(CFG, 256.0)[0] is None  # the nodes keep their memory: the floor keeps the loan
    assert give_back(resizes, 64.0)[0] is None  # the user asked no more than the nodes hold
    answer, after = give_back(resizes, 256.0)
    assert isinstance(answer, Decision) and len(answer.members) == 2, answer
    assert after.advice.target_nodes == 2
    assert 64.0 * gib < after.advice.mem_per_node_bytes <= 256.0 * gib, after.advice  # the carried memory
