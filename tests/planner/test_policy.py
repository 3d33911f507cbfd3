"""Scenario tests of PlannerPolicy: each stage answers the situation it is for, with a reason."""

from dataclasses import replace

import pytest

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, RoundView, Wait
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import PlannerState

from .helpers import JOB, feed, node, running

CFG = PlannerConfig(
    sample_interval_s=10,
    profile_window_s=30,
    min_profile_samples=2,
    cooldown_s=60,
    straggler_enter=3,
    straggler_exit=2,
    oom_horizon_s=300,
    mem_growth_horizon_s=600,
    round_warmup_s=0,
    min_trend_span_s=0,
)


def settled(policy: PlannerPolicy, members: list[str], t0: float = 100.0, **kw) -> PlannerState:
    """State after the first round was written at t=0 and observed quietly until t0."""
    _, st = feed(policy, [running(t, members, number=0, **kw) for t in range(0, int(t0), 10)])
    return st


def test_first_round_starts_with_the_requested_world_in_arrival_order():
    p = PlannerPolicy(CFG)
    nodes = tuple(node(n, i, seen_at=0.0) for i, n in enumerate(["c", "a", "b"]))
    snap = ClusterSnapshot(5.0, 1, 8, 30.0, nodes, None, dict(JOB))
    a, st = p.step(snap, PlannerState())
    assert isinstance(a, Decision)
    assert a.members == ("c", "a") and a.standby == ("b",)  # request: 2 nodes; standby_max 1
    assert "cold start" in a.reason and a.confidence is not None
    # and while only one of the two is there, it waits for the last call
    one = replace(snap, nodes=nodes[:1], now=5.0)
    w, _ = p.step(one, PlannerState())
    assert isinstance(w, Wait) and w.until == pytest.approx(30.0)
    late = replace(one, now=31.0)
    assert p.step(late, PlannerState())[0].members == ("c",)


def test_lost_member_gives_an_immediate_round_of_survivors_even_in_cooldown():
    p = PlannerPolicy(CFG)
    st = settled(p, ["a", "b", "c"], t0=20)
    snap = running(20.0, ["a", "b", "c"], extra=["d"], decided_at=15.0)
    snap = replace(snap, nodes=tuple(n for n in snap.nodes if n.node_id != "b"))
    a, st2 = p.step(snap, st)
    assert isinstance(a, Decision) and a.members == ("a", "c", "d") and "lost" in a.reason
    # with MIN = 3 and nobody to fill in, it suspends the job (empty round, survivors on standby)
    short = replace(snap, nodes=tuple(n for n in snap.nodes if n.node_id != "d"), min_nodes=3)
    s, _ = p.step(short, st)
    assert isinstance(s, Decision) and s.members == () and s.standby == ("a", "c") and "suspended" in s.reason


def test_a_decision_is_not_repeated_before_the_round_is_written():
    p = PlannerPolicy(CFG)
    st = settled(p, ["a", "b", "c"], t0=20)
    snap = running(20.0, ["a", "b", "c"])
    snap = replace(snap, nodes=snap.nodes[:2])
    a, st = p.step(snap, st)
    assert isinstance(a, Decision)
    # the survivors' round is not written yet and nothing changed: no duplicate decision
    again, st2 = p.step(replace(snap, now=21.0), st)
    assert isinstance(again, Wait) and "not yet written" in again.reason
    # but a changed situation (a node arrived) may refine it
    refined, _ = p.step(replace(snap, nodes=snap.nodes[:2] + (node("z", 50),), now=22.0), st2)
    assert isinstance(refined, Decision) and refined.members == ("a", "b", "z")


def test_straggler_is_flagged_after_the_window_and_replaced_by_a_standby():
    p = PlannerPolicy(CFG)
    members = ["a", "b", "c", "d"]
    st = settled(p, members, extra=["e"], t0=100, max_nodes=4)
    answers, st = feed(
        p, [running(t, members, extra=["e"], slow={"d": 2.0}, max_nodes=4) for t in (100, 110)], st
    )
    assert all(isinstance(a, Wait) for a in answers) and "d" not in st.flagged  # 2 slow samples: not yet
    a, st = p.step(running(120, members, extra=["e"], slow={"d": 2.0}, max_nodes=4), st)
    assert isinstance(a, Decision)
    assert a.members == ("a", "b", "c", "e") and "straggler" in a.reason and "d" not in a.standby


def test_hysteresis_ignores_a_short_blip():
    p = PlannerPolicy(CFG)
    members = ["a", "b", "c", "d"]
    st = settled(p, members, extra=["e"], t0=100, max_nodes=4)
    snaps = [
        running(t, members, extra=["e"], slow={"d": 2.0} if t in (100, 110, 130) else None, max_nodes=4)
        for t in range(100, 170, 10)
    ]
    answers, st = feed(p, snaps, st)
    assert not any(isinstance(a, Decision) and "straggler" in a.reason for a in answers)
    assert "d" not in st.flagged


def test_a_new_rounds_memory_ramp_is_not_an_oom_trend():
    """Workers loading tables fill memory fast for a few seconds; that is not a trend to act on."""
    p = PlannerPolicy(replace(CFG, round_warmup_s=40))
    members = ["a", "b"]
    mem = lambda t: min(10.0 + 1.0 * t, 30.0)  # GiB: +1 GiB/s for 20 s, then flat  # noqa: E731
    answers, st = feed(
        p, [running(t, members, extra=["c"], number=1, mem_gib=mem(t)) for t in range(0, 120, 10)]
    )
    assert not any("OOM" in a.reason or "memory floor" in a.reason for a in answers)
    assert any(isinstance(a, Decision) and "scale up" in a.reason for a in answers)  # for throughput
    # the same ramp with no warm-up would have been read as a trend towards the limit
    eager = PlannerPolicy(CFG)
    answers, _ = feed(
        eager, [running(t, members, extra=["c"], number=1, mem_gib=mem(t)) for t in range(0, 40, 10)]
    )
    assert any("OOM" in a.reason for a in answers)


def test_a_trend_through_a_few_seconds_is_not_extrapolated():
    """+1 GiB/s for 15 s would reach the limit in minutes, but 15 s say little about the next minutes."""
    cfg = replace(CFG, sample_interval_s=1, window=30, min_trend_span_s=30, round_warmup_s=0)
    mem = lambda t: 10.0 + 1.0 * t  # noqa: E731
    snaps = [running(t, ["a", "b"], number=1, mem_gib=mem(t)) for t in range(0, 16)]
    answers, _ = feed(PlannerPolicy(cfg), snaps)
    assert not any("OOM" in a.reason or "memory floor" in a.reason for a in answers)
    # the limit comes at t = 47.6: acted on once it is no further ahead than the job has run
    snaps = [running(t, ["a", "b"], number=1, mem_gib=mem(t)) for t in range(0, 30)]
    answers, _ = feed(PlannerPolicy(replace(cfg, min_trend_span_s=5)), snaps)
    assert any("OOM" in a.reason for a in answers)


def test_gpu_throttling_counts_as_slow():
    p = PlannerPolicy(CFG)
    members = ["a", "b", "c"]
    st = settled(p, members, extra=["e"], t0=100, max_nodes=3)
    answer = None
    for t in (100, 110, 120):
        snap = running(t, members, extra=["e"], max_nodes=3)
        snap = replace(
            snap,
            nodes=tuple(
                replace(n, metrics=replace(n.metrics, gpu_throttled=True)) if n.node_id == "b" else n
                for n in snap.nodes
            ),
        )
        answer, st = p.step(snap, st)
    assert isinstance(answer, Decision) and "b" not in answer.members and "e" in answer.members


def test_oom_trend_shards_over_more_nodes_before_the_limit():
    p = PlannerPolicy(CFG)
    members = ["a", "b"]
    # GiB; threshold 0.9 x 64 = 57.6 GiB reached at t = 252, within oom_horizon_s from the start
    mem = lambda t: 45.0 + 0.05 * t  # noqa: E731
    st = settled(p, members, mem_gib=mem(0), t0=10)
    answers, st = feed(
        p, [running(t, members, extra=["c", "d"], mem_gib=mem(t)) for t in range(10, 200, 10)], st
    )
    d = [a for a in answers if isinstance(a, Decision)]
    assert d and len(d[0].members) > 2
    assert "OOM predicted" in d[0].reason or "memory floor" in d[0].reason
    # without a node to add it says so and asks for nodes instead
    st = settled(p, members, mem_gib=mem(0), t0=10)
    answers, st = feed(p, [running(t, members, mem_gib=mem(t)) for t in range(10, 200, 10)], st)
    assert not any(isinstance(a, Decision) for a in answers)
    assert any("asking for" in a.reason for a in answers) and st.advice.target_nodes > 2


def test_oom_with_resizable_rounds_raises_the_memory_budget():
    p = PlannerPolicy(replace(CFG, resize_rounds=True))
    members = ["a", "b"]
    st = settled(p, members, t0=10)
    answers, st = feed(p, [running(t, members, mem_gib=40.0 + 0.05 * t) for t in range(10, 200, 10)], st)
    d = [a for a in answers if isinstance(a, Decision)]
    assert d and d[0].members == ("a", "b") and "memory budget" in d[0].reason
    assert st.advice.mem_per_node_bytes > 57.6 * 2**30


def test_stage2_scales_up_after_profiling_with_gain_and_confidence():
    p = PlannerPolicy(CFG)
    members = ["a", "b"]
    extra = ["c", "d", "e", "f", "g", "h"]
    st = settled(p, members, extra=extra, t0=10)
    answers, st = feed(p, [running(t, members, extra=extra) for t in range(10, 200, 10)], st)
    d = [a for a in answers if isinstance(a, Decision)]
    assert d, [a.reason for a in answers]
    assert "scale up" in d[0].reason and len(d[0].members) > 2 and d[0].members[:2] == ("a", "b")
    assert d[0].predicted_gain > 0 and 0 <= d[0].confidence <= 1
    # profiling comes first: nothing before the profiling window has passed
    first = next(i for i, a in enumerate(answers) if isinstance(a, Decision))
    assert 10 + 10 * first >= CFG.profile_window_s


def test_cooldown_holds_planned_rounds():
    p = PlannerPolicy(CFG)
    st = settled(p, ["a", "b"], t0=10)
    a, _ = p.step(running(40, ["a", "b"], extra=["c", "d"], decided_at=35.0), st)
    assert isinstance(a, Wait) and "cooldown" in a.reason and a.until == pytest.approx(95.0)


def test_without_a_job_model_it_is_the_membership_policy():
    p = PlannerPolicy(CFG)
    snap = replace(running(10, ["a", "b"], extra=["c"], extra_seen_at=0.0), job={}, now=40.0)
    a, st = p.step(snap, PlannerState())
    assert isinstance(a, Decision) and a.members == ("a", "b", "c") and st == PlannerState()


def test_decide_threads_state_like_step():
    snaps = [running(t, ["a", "b"], extra=["c", "d"]) for t in range(0, 200, 10)]
    p1, p2 = PlannerPolicy(CFG), PlannerPolicy(CFG)
    via_decide = [p1.decide(s) for s in snaps]
    via_step, st = feed(p2, snaps)
    assert via_decide == via_step and p1.state == st


def test_stage2_scales_down_an_over_provisioned_job_and_sets_budgets():
    p = PlannerPolicy(CFG)
    members = [f"n{i}" for i in range(8)]
    # communication-bound job: dense all-reduce of 2 GB over 10 GbE; more nodes only add time
    job = {**JOB, "dense_params": 500_000_000, "bandwidth": 1.25e9}
    st = settled(p, members, t0=10, job=job)
    snaps = []
    for t in range(10, 200, 10):
        s = running(t, members, job=job)
        # every node reports a step dominated by a fixed communication time that grows with the world
        s = replace(
            s,
            nodes=tuple(
                replace(
                    n,
                    metrics=replace(
                        n.metrics, steps=replace(n.metrics.steps, p50_s=1.0, samples_per_s=8192 / 1.0 / 8)
                    ),
                )
                for n in s.nodes
            ),
        )
        snaps.append(s)
    answers, st = feed(p, snaps, st)
    d = [a for a in answers if isinstance(a, Decision)]
    assert d and "scale down" in d[0].reason and len(d[0].members) < 8
    assert d[0].members == tuple(members[: len(d[0].members)])  # the first ranks stay
    assert st.advice.cpu_per_node > 0 and st.advice.mem_per_node_bytes > 8 * 2**30


def test_profiling_flag_off_decides_on_the_first_sample():
    members, extra = ["a", "b"], ["c", "d", "e", "f"]
    first = {}
    for flag in (True, False):
        p = PlannerPolicy(replace(CFG, profiling=flag, profile_window_s=100))
        st = settled(p, members, extra=extra, t0=10)
        answers, _ = feed(p, [running(t, members, extra=extra) for t in range(10, 300, 10)], st)
        first[flag] = next(10 + 10 * i for i, a in enumerate(answers) if isinstance(a, Decision))
    assert first[False] < 100 <= first[True]


def test_a_lost_member_is_not_replaced_by_a_flagged_straggler_unless_min_needs_it():
    p = PlannerPolicy(CFG)
    st = settled(p, ["a", "b", "c"], t0=20)
    st = replace(st, flagged=frozenset({"s"}))  # s was replaced as a straggler and waits
    snap = running(20.0, ["a", "b", "c"], extra=["s"], decided_at=15.0)
    snap = replace(snap, nodes=tuple(n for n in snap.nodes if n.node_id != "b"))
    a, _ = p.step(snap, st)
    assert isinstance(a, Decision) and a.members == ("a", "c") and "s" not in a.standby
    a, _ = p.step(replace(snap, min_nodes=3), st)  # but a slow node beats stopping the job
    assert isinstance(a, Decision) and a.members == ("a", "c", "s")


BIG_TABLES = {**JOB, "tables": [{"rows": 100_000_000, "dim": 64}] * 4}  # ~100 GB of tables


def _grown(snap: ClusterSnapshot, gib: float) -> ClusterSnapshot:
    """``snap`` with every node's memory at ``gib`` (a resize that took that far)."""
    size = int(gib * 2**30)
    grown = tuple(
        replace(n, mem_total_bytes=size, metrics=replace(n.metrics, mem_total_bytes=size)) for n in snap.nodes
    )
    return replace(snap, nodes=grown)


def test_an_oom_after_a_raise_capped_by_the_node_suspends_until_the_nodes_it_fits_on_are_there():
    """A job that started on one node (the cluster had one free) and OOMs there: the raise is asked once;
    it takes only up to the machine's size (64 -> 96 GiB, 128 asked) and the job OOMs again with no node
    free: the run is suspended (its node waits as standby) instead of restarting into the same OOM until
    its restarts run out, and the next round waits for the nodes its memory fits on."""
    p = PlannerPolicy(replace(CFG, resize_rounds=True))
    job = lambda ooms: {**BIG_TABLES, "oom_count": ooms}  # noqa: E731
    st = settled(p, ["a"], t0=20, job=job(0), mem_gib=60.0)
    first, st = p.step(running(20, ["a"], job=job(1), mem_gib=60.0), st)
    assert isinstance(first, Decision) and first.members == ("a",) and "memory budget" in first.reason
    # a raise that did not take at all (the machine had no room then) is asked again: room may come
    again, st_again = p.step(running(40, ["a"], number=1, job=job(2), mem_gib=60.0, decided_at=20.0), st)
    assert isinstance(again, Decision) and again.members == ("a",) and st_again.fit_nodes == 0
    # the raise took up to the node's size, short of the ask, and the job OOMs again
    snap = _grown(running(40, ["a"], number=1, job=job(2), mem_gib=90.0, decided_at=20.0), 96.0)
    second, st = p.step(snap, st)
    assert isinstance(second, Decision), second.reason
    assert second.members == () and second.standby == ("a",) and "suspended until" in second.reason
    assert 2 <= st.fit_nodes <= 8 and st.advice.target_nodes >= st.fit_nodes
    assert st.advice.mem_per_node_bytes < 96 * 2**30  # the budget is for the nodes it waits for
    # suspended: one node present is not enough, whatever the last call says
    suspended = RoundView(2, (), ("a",), 40.0)
    alone = ClusterSnapshot(400.0, 1, 8, 30.0, (node("a", 0),), suspended, job(2))
    wait, st = p.step(alone, st)
    assert isinstance(wait, Wait) and f"fits on {st.fit_nodes}" in wait.reason
    enough = replace(alone, nodes=tuple(node(n, i) for i, n in enumerate("abcdefgh"[: st.fit_nodes])))
    resumed, _ = p.step(enough, st)
    assert isinstance(resumed, Decision) and len(resumed.members) >= st.fit_nodes


def test_a_run_below_its_start_size_whose_raise_never_takes_suspends_after_asking_twice():
    """Started on one node of the two its memory was planned for, it OOMs, and the node never grows (it is
    as large as a machine gets): the raise is asked once more, then the run waits for the nodes instead
    of restarting into the same OOM until its restarts run out."""
    p = PlannerPolicy(replace(CFG, resize_rounds=True))
    job = lambda ooms: {**BIG_TABLES, "oom_count": ooms}  # noqa: E731
    st = settled(p, ["a"], t0=20, job=job(0), mem_gib=60.0)
    assert st.start.world >= 2  # the run is below its start size
    first, st = p.step(running(20, ["a"], job=job(1), mem_gib=60.0), st)
    assert isinstance(first, Decision) and first.members == ("a",) and "memory budget" in first.reason
    again, st = p.step(running(40, ["a"], number=1, job=job(2), mem_gib=60.0, decided_at=20.0), st)
    assert isinstance(again, Decision) and again.members == ("a",) and st.fit_nodes == 0
    third, st = p.step(running(60, ["a"], number=2, job=job(3), mem_gib=60.0, decided_at=40.0), st)
    assert isinstance(third, Decision) and third.members == () and "suspended until" in third.reason
    assert st.fit_nodes >= 2


def test_an_oom_after_a_capped_raise_shards_onto_a_free_node_instead():
    p = PlannerPolicy(replace(CFG, resize_rounds=True))
    job = lambda ooms: {**BIG_TABLES, "oom_count": ooms}  # noqa: E731
    st = settled(p, ["a"], t0=20, job=job(0), mem_gib=60.0)
    _, st = p.step(running(20, ["a"], job=job(1), mem_gib=60.0), st)
    snap = running(40, ["a"], extra=["b", "c", "d"], number=1, job=job(2), mem_gib=90.0, decided_at=20.0)
    second, st = p.step(_grown(snap, 96.0), st)
    assert isinstance(second, Decision) and len(second.members) >= 2 and "sharding over" in second.reason
    assert st.fit_nodes == 0


def test_a_raise_asked_again_once_early_does_not_make_a_later_failed_raise_suspend_at_once():
    """Below its start size, a raise asked again that then took is settled: a later OOM whose fresh raise
    does not take is asked again too, as the first was, before the run suspends."""
    p = PlannerPolicy(replace(CFG, resize_rounds=True))
    job = lambda ooms: {**BIG_TABLES, "oom_count": ooms}  # noqa: E731
    st = settled(p, ["a"], t0=20, job=job(0), mem_gib=60.0)
    assert st.start.world >= 2  # the run is below its start size
    first, st = p.step(running(20, ["a"], job=job(1), mem_gib=60.0), st)
    assert isinstance(first, Decision) and "memory budget" in first.reason
    again, st = p.step(running(40, ["a"], number=1, job=job(2), mem_gib=60.0, decided_at=20.0), st)
    assert isinstance(again, Decision) and again.members == ("a",) and st.mem_reasks == 1
    took = st.mem_asked / 2**30 + 1.0  # the raise asked again took
    snap = _grown(running(60, ["a"], number=2, job=job(2), mem_gib=60.0, decided_at=40.0), took)
    _, st = p.step(snap, st)
    later = _grown(running(80, ["a"], number=2, job=job(3), mem_gib=took - 2, decided_at=40.0), took)
    fresh, st = p.step(later, st)
    assert isinstance(fresh, Decision) and "memory budget" in fresh.reason, fresh
    # the fresh raise does not take: asked again, not suspended at once
    snap = _grown(running(100, ["a"], number=3, job=job(4), mem_gib=took - 2, decided_at=80.0), took)
    retry, st = p.step(snap, st)
    assert isinstance(retry, Decision) and retry.members == ("a",) and "memory budget" in retry.reason, retry


def test_a_run_below_its_request_moves_up_to_it_when_the_loan_past_it_does_not_repay_two_rounds_yet():
    """History started the run on 2 of the 4 nodes requested; the model wants 8. Past the request a loan
    repays two rounds (a queue can call it in), which it does not yet; the way up to the request is no
    loan: it moves there as soon as that repays its one round, instead of not moving at all."""
    from elastic_rm.planner.state import Advice

    job = {**JOB, "request": {**JOB["request"], "nodes": 4}}
    p, extra = PlannerPolicy(CFG), ["c", "d", "e", "f", "g", "h"]
    snap = lambda now: replace(  # noqa: E731  the first round was decided at 1 s; it ran from 101 s
        running(now, ["a", "b"], extra=extra, job=job, decided_at=1.0), waiting_nodes=0
    )
    _, first = p.step(snap(101), PlannerState())
    start = replace(first.start, world=2)
    st = PlannerState(start=start, advice=Advice(2, start.cpu_per_node, start.mem_per_node_bytes, "warm"))
    moves = []
    for now in range(101, 1000, 10):
        answer, st = p.step(snap(now), st)
        if isinstance(answer, Decision):
            moves.append(answer)
            break
    assert moves and len(moves[0].members) == 4 and "up to the request of 4" in moves[0].reason, moves
