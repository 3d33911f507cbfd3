"""The user's rule ("never worse than the user", docs/planner.md) as hypothesis invariants, and the
remembered measurements that stop the scale-up / take-back oscillation."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import ClusterSnapshot, Decision, RoundView
from elastic_rm.planner.job import parse_job
from elastic_rm.planner.perf_model import Fit, marginal_gains
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.scaling import choose_world, shape_of, user_floor
from elastic_rm.planner.state import ConfigSample, PlannerState, keep_configs

from .helpers import JOB, node

EPS = PlannerConfig().user_loss_max
coefs = st.tuples(*(st.floats(0.0, 1e-3) for _ in range(3)), st.floats(1e-4, 0.05))


@settings(max_examples=200, deadline=None)
@given(coefs, st.integers(1, 16), st.integers(1, 4), st.integers(0, 16), st.integers(1, 24))
def test_a_scale_down_keeps_the_request_throughput(coef, request, lo, extra, current):
    """Below the request, a scale-down only reaches sizes the model predicts within EPS of the request."""
    cfg = PlannerConfig()
    hi = lo + extra
    job = parse_job({**JOB, "request": {**JOB["request"], "nodes": request}})
    f = Fit(coef, float("nan"), 0.0, 1, (current,))
    shape = shape_of(job)
    ref = min(max(request, lo), hi)
    floor, _ = user_floor(f, job, 1.0, ref, lo, EPS, [])
    assert lo <= floor <= max(ref, lo)
    assert floor == ref or f.throughput(shape, floor, 1.0) >= (1 - EPS) * f.throughput(shape, ref, 1.0)
    cur = min(max(current, lo), hi)
    t = choose_world(f, job, 1.0, cur, lo, hi, cfg, None, floor, "user")
    if t.world < cur:
        assert t.world >= floor
        assert t.world >= ref or f.throughput(shape, t.world, 1.0) >= (1 - EPS) * f.throughput(
            shape, ref, 1.0
        )


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 12), st.floats(0.5, 1.5), st.floats(0.5, 1.5))
def test_measured_sizes_overrule_the_model(request, ratio_below, model_ratio):
    """Once the request and a smaller size both ran, the measurement decides: a loss beyond EPS puts the
    floor back at the request whatever the model says, and a size within EPS is accepted."""
    job = parse_job(JOB)
    f = Fit((1e-5 * model_ratio, 0.0, 0.0, 0.01), float("nan"), 0.0, 1, (request,))
    below = request - 1
    measured = [(request, 0.1), (request, 0.1), (below, 0.1 / ratio_below), (below, 0.1 / ratio_below)]
    floor, _ = user_floor(f, job, 1.0, request, 1, EPS, measured)
    if ratio_below < 1 - EPS:
        assert floor == request
    else:
        assert floor <= below


def test_measured_sizes_are_remembered_for_the_whole_run():
    """A size measured early stays in the state after many later samples of other sizes."""
    configs = tuple(ConfigSample(float(t), 0, 2, 1.0, 0.1) for t in range(3))
    configs += tuple(ConfigSample(float(t), 1, 3, 1.0, 0.12) for t in range(3, 300))
    kept = keep_configs(configs)
    assert sum(c.world == 2 for c in kept) == 3
    assert sum(c.world == 3 for c in kept) == 8


def _snapshot(now, members, waiting, number, step_of, job, decided_at=0.0):
    w = len(members)
    t = step_of(w)
    views = [node(m, i, busy=t, tp=job["global_batch"] / t / w) for i, m in enumerate(members)]
    views += [node(n, 100 + i, seen_at=0.0) for i, n in enumerate(waiting)]
    cur = RoundView(number, tuple(members), (), decided_at)
    return ClusterSnapshot(now, 1, 8, 5.0, tuple(views), cur, job)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 8), st.floats(0.0, 0.3), st.floats(0.002, 0.05))
def test_the_job_never_stays_below_the_user(request, comm, fixed):
    """A job on the model's own kind of curve: whatever the planner explores, it never decides a size
    below the request whose true throughput is more than EPS under the request's twice, and it never
    decides a size the job already measured as a loss against the rule (no scale-up / take-back loop)."""
    cfg = PlannerConfig(
        sample_interval_s=10, profile_window_s=30, min_profile_samples=2, cooldown_s=60, round_warmup_s=0
    )
    job = {**JOB, "request": {**JOB["request"], "nodes": request}}

    def step_of(w: int) -> float:
        return 2e-5 * job["global_batch"] / w + comm * (w - 1) / w + fixed

    def tp(w: int) -> float:
        return 1.0 / step_of(w)

    pool = [f"n{i}" for i in range(8)]
    members, number, decided_at = pool[:request], 0, 0.0
    p, state = PlannerPolicy(cfg), PlannerState()
    sizes, below_bad = [], 0
    for i in range(300):
        now = 10.0 * (i + 1)
        waiting = [n for n in pool if n not in members]
        answer, state = p.step(_snapshot(now, members, waiting, number, step_of, job, decided_at), state)
        if isinstance(answer, Decision) and answer.members:
            members, number, decided_at = list(answer.members), number + 1, now
            w = len(members)
            sizes.append(w)
            if w < request and tp(w) < (1 - EPS) * tp(request):
                below_bad += 1
    assert below_bad <= 1, f"sizes decided: {sizes}"
    final = len(members)
    assert final >= request or tp(final) >= (1 - EPS) * tp(request), f"ends below the user: {sizes}"
    for i in range(2, len(sizes)):  # A -> B -> A -> B is a loop
        assert not (i >= 3 and sizes[i] == sizes[i - 2] and sizes[i - 1] == sizes[i - 3]), f"loop: {sizes}"


def test_a_scale_up_that_lost_is_taken_back_once_and_never_tried_again():
    """The demo on 2 cores: a third node makes every step slower. The planner may try it once (its prior
    predicts a gain), measures the loss, takes the node back within a window, and never scales up again
    however long the job runs (the measured size is remembered past any sample window)."""
    cfg = PlannerConfig(
        sample_interval_s=1, profile_window_s=6, min_profile_samples=2, cooldown_s=6, round_warmup_s=0
    )
    job = {**JOB, "request": {**JOB["request"], "nodes": 2}}

    def step_of(w: int) -> float:  # 2 cores shared: a third worker adds contention, not compute
        return {1: 0.20, 2: 0.12, 3: 0.16}[w]

    pool = ["a", "b", "c"]
    members, number, decided_at = ["a", "b"], 0, 0.0
    p, state = PlannerPolicy(cfg), PlannerState()
    sizes = []
    for i in range(400):  # 400 s, far beyond the 64-sample window that used to forget world 3
        now = 1.0 * (i + 1)
        waiting = [n for n in pool if n not in members]
        snap = _snapshot(now, members, waiting, number, step_of, job, decided_at)
        answer, state = p.step(snap, state)
        if isinstance(answer, Decision) and answer.members:
            members, number, decided_at = list(answer.members), number + 1, now
            sizes.append((now, len(members)))
    assert [w for _, w in sizes] in ([], [3, 2]), sizes
    if sizes:
        assert sizes[1][0] - sizes[0][0] <= 30, "taken back within one profiling window and cooldown"


def test_waiting_nodes_do_not_undo_a_measured_scale_down():
    """Communication-bound and over-requested: fewer nodes are faster. Once stage 2 scaled down, the
    standby nodes still waiting never bring the job back up to the request."""
    cfg = PlannerConfig(
        sample_interval_s=10, profile_window_s=30, min_profile_samples=2, cooldown_s=60, round_warmup_s=0
    )
    job = {**JOB, "bandwidth": 2e8, "request": {**JOB["request"], "nodes": 6}}
    shape = shape_of(parse_job(job))

    def step_of(w: int) -> float:  # the model's own form at wire speed: the prior is right
        return Fit((2e-6, 1.0, 1.0, 0.005), float("nan"), 0.0, 1, (6,)).step_s(shape, w, 1.0)

    pool = [f"n{i}" for i in range(8)]
    members, number, decided_at = pool[:6], 0, 0.0
    p, state = PlannerPolicy(cfg), PlannerState()
    sizes = []
    for i in range(200):
        now = 10.0 * (i + 1)
        waiting = [n for n in pool if n not in members]
        answer, state = p.step(_snapshot(now, members, waiting, number, step_of, job, decided_at), state)
        if isinstance(answer, Decision) and answer.members:
            members, number, decided_at = list(answer.members), number + 1, now
            sizes.append(len(members))
    assert sizes and sizes[0] < 6, sizes  # it did scale down (fewer nodes are faster here)
    assert sizes == sorted(sizes, reverse=True), f"went back up: {sizes}"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.floats(0.0, 0.6), st.floats(0.2, 1.0))
def test_past_the_request_each_node_brings_the_lent_bar(request, comm, lent):
    """Growth beyond the request (capacity a shared cluster lends) asks more of each added node: a higher
    ``lent_node_gain`` never gives a larger world, the first nodes past the request clear it, and up to
    the request the 20% bar is unchanged."""
    job = parse_job(JOB)
    shape = shape_of(job)
    f = Fit((2e-6, comm, comm, 0.01), float("nan"), 0.0, 1, (request,))
    cfg = replace(PlannerConfig(), lent_node_gain=lent)
    plain = choose_world(f, job, 1.0, request, 1, 16, PlannerConfig(), request=request)
    t = choose_world(f, job, 1.0, request, 1, 16, cfg, request=request)
    assert request <= t.world <= max(plain.world, request)
    if t.world > request:
        tp = marginal_gains(f, shape, 1.0, 1, 16)
        k = next(
            k
            for k in range(request + 1, t.world + 1)
            if tp[k] - tp[request] >= lent * (k - request) * tp[request] / request * (1 - 1e-9)
        )
        assert k <= t.world, (t.world, t.why)
    below = choose_world(f, job, 1.0, 1, 1, 16, cfg, request=request)  # from 1 node up to the request
    assert min(below.world, request) == min(
        choose_world(f, job, 1.0, 1, 1, 16, PlannerConfig()).world, request
    )


def test_a_raised_lent_bar_keeps_a_right_sized_job_at_its_request():
    job = parse_job(JOB)
    f = Fit((2e-6, 0.3, 0.3, 0.01), float("nan"), 0.0, 1, (2,))  # nodes 3..5 bring 30%..21% each
    assert choose_world(f, job, 1.0, 2, 1, 8, PlannerConfig(), request=2).world == 5
    t = choose_world(f, job, 1.0, 2, 1, 8, replace(PlannerConfig(), lent_node_gain=0.75), request=2)
    assert t.world == 2, t.why
