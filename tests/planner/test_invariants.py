"""Hypothesis invariants of PlannerPolicy: bounds, liveness, determinism, no oscillation."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, NodeState, RoundView
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import PlannerState

from .helpers import JOB, node, step_s

CFG = PlannerConfig(
    sample_interval_s=10,
    profile_window_s=30,
    min_profile_samples=2,
    cooldown_s=60,
    straggler_enter=2,
    straggler_exit=2,
    oom_horizon_s=300,
    mem_growth_horizon_s=600,
)
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class World:
    """Alive nodes with speeds and memory; applies Decisions as rounds."""

    def __init__(self, n: int, lo: int, hi: int, with_job: bool) -> None:
        self.lo, self.hi, self.job = lo, hi, dict(JOB) if with_job else {}
        self.nodes: dict[str, dict] = {}
        self.next = 0
        self.current: RoundView | None = None
        for _ in range(n):
            self.add(0.0)

    def add(self, now: float, slow: float = 1.0, joining: bool = False) -> None:
        nid = f"n{self.next}"
        self.nodes[nid] = {"arrival": self.next, "seen": now, "slow": slow, "mem": 8.0, "joining": joining}
        self.next += 1

    def snapshot(self, now: float) -> ClusterSnapshot:
        members = [m for m in (self.current.members if self.current else ()) if m in self.nodes]
        w = max(len(members), 1)
        t = step_s(w) * max([1.0, *(self.nodes[m]["slow"] for m in members)])
        views = []
        for nid, d in self.nodes.items():
            busy = step_s(w) * d["slow"] if nid in members else None
            v = node(
                nid,
                d["arrival"],
                busy=busy,
                tp=8192 / t / w,
                mem_gib=d["mem"],
                seen_at=d["seen"],
                state=NodeState.JOINING if d["joining"] else NodeState.ACTIVE,
            )
            views.append(v)
        return ClusterSnapshot(now, self.lo, self.hi, 20.0, tuple(views), self.current, self.job)

    def apply(self, d: Decision, now: float) -> None:
        n = self.current.number + 1 if self.current else 0
        self.current = RoundView(n, d.members, d.standby, now, d.reason)


events = st.lists(
    st.tuples(st.sampled_from(["none", "kill", "add", "slow", "fast", "grow", "join"]), st.integers(0, 30)),
    min_size=5,
    max_size=60,
)


def play(seed_nodes: int, lo: int, hi: int, with_job: bool, evs, check=None):
    world = World(seed_nodes, lo, hi, with_job)
    p, state = PlannerPolicy(CFG), PlannerState()
    answers = []
    for i, (kind, k) in enumerate(evs):
        now = 10.0 * (i + 1)
        ids = sorted(world.nodes)
        if kind == "kill" and ids:
            del world.nodes[ids[k % len(ids)]]
        elif kind == "add":
            world.add(now)
        elif kind == "join":
            world.add(now, joining=True)
        elif kind in ("slow", "fast") and ids:
            world.nodes[ids[k % len(ids)]]["slow"] = 2.5 if kind == "slow" else 1.0
        elif kind == "grow" and ids:
            for d in world.nodes.values():
                d["mem"] = min(d["mem"] + k, 63.0)
        snap = world.snapshot(now)
        answer, state = p.step(snap, state)
        answers.append(answer)
        if check:
            check(snap, answer)
        if isinstance(answer, Decision):
            world.apply(answer, now)
    return answers, state


@FAST
@given(st.integers(0, 8), st.integers(1, 3), st.integers(0, 6), st.booleans(), events)
def test_bounds_and_liveness(n, lo, extra, with_job, evs):
    hi = lo + extra

    def check(snap: ClusterSnapshot, answer) -> None:
        if not isinstance(answer, Decision):
            return
        eligible = {v.node_id for v in snap.nodes}
        if answer.members:  # an empty round suspends the job (below MIN after a loss)
            assert snap.min_nodes <= len(answer.members) <= snap.max_nodes
        else:
            assert "suspended" in answer.reason
        assert set(answer.members) <= eligible, "a member that is not alive"
        assert len(set(answer.members)) == len(answer.members)
        assert set(answer.standby) <= eligible and not set(answer.standby) & set(answer.members)
        assert answer.reason

    play(n, lo, hi, with_job, evs, check)


@FAST
@given(st.integers(0, 8), st.integers(1, 3), st.integers(0, 6), st.booleans(), events)
def test_lost_member_always_answered_when_min_survives(n, lo, extra, with_job, evs):
    """Liveness: a round missing a member is replaced at once when MIN nodes are eligible."""

    def check(snap: ClusterSnapshot, answer) -> None:
        cur = snap.current
        eligible = {v.node_id for v in snap.nodes}
        if cur and any(m not in eligible for m in cur.members) and len(eligible) >= snap.min_nodes:
            assert isinstance(answer, Decision) or "not yet written" in answer.reason

    play(n, lo, lo + extra, with_job, evs, check)


@FAST
@given(st.integers(0, 8), st.integers(1, 3), st.integers(0, 6), st.booleans(), events)
def test_deterministic(n, lo, extra, with_job, evs):
    a1, s1 = play(n, lo, lo + extra, with_job, evs)
    a2, s2 = play(n, lo, lo + extra, with_job, evs)
    assert a1 == a2 and s1 == s2


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(1, 8), st.integers(1, 3), st.integers(0, 6), st.booleans())
def test_no_oscillation_under_constant_input(n, lo, extra, with_job):
    """Same nodes, same speeds, same memory for 1200 s: a few rounds at most, then none, never A-B-A."""
    answers, _ = play(n, lo, lo + extra, with_job, [("none", 0)] * 120)
    rounds = [(i, a.members) for i, a in enumerate(answers) if isinstance(a, Decision)]
    assert len(rounds) <= 4
    assert all(i < 60 for i, _ in rounds), "still changing after 600 s of constant input"
    seen = [m for _, m in rounds]
    for i in range(2, len(seen)):
        assert seen[i] != seen[i - 2] or seen[i] == seen[i - 1], "oscillation"


def test_same_snapshot_twice_changes_nothing():
    world = World(4, 1, 8, True)
    p, state = PlannerPolicy(CFG), PlannerState()
    for t in range(0, 100, 10):
        a, state = p.step(world.snapshot(float(t)), state)
        if isinstance(a, Decision):
            world.apply(a, float(t))
    for t in (100.0, 105.0):  # once with a fresh sample, once between samples
        snap = world.snapshot(t)
        a1, s1 = p.step(snap, state)
        a2, s2 = p.step(snap, s1)
        assert s2 == s1
        assert not isinstance(a2, Decision)
        if not isinstance(a1, Decision):
            assert a2 == a1
