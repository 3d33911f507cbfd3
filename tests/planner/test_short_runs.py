"""A job is expected to run about as long as it has run: a run the cluster started short of its size
catches up at once when that repays the round within that time, and an OOM further ahead than that is
not paid for with a round yet (docs/planner.md, "The promise")."""

from __future__ import annotations

from dataclasses import replace

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.interface import Decision
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.planner.state import PlannerState

from .helpers import feed, running

CFG = PlannerConfig(
    sample_interval_s=10,
    profile_window_s=30,
    min_profile_samples=2,
    cooldown_s=600,
    round_warmup_s=0,
    min_trend_span_s=0,
    oom_horizon_s=900,
)


def _rounds(cfg: PlannerConfig, snaps, state: PlannerState | None = None) -> list[tuple[float, Decision]]:
    """(time, decision) of the first round the planner decides on these snapshots, if any."""
    answers, _ = feed(PlannerPolicy(cfg), snaps, state)
    return [(s.now, a) for s, a in zip(snaps, answers, strict=True) if isinstance(a, Decision)][:1]


def _oom_answers(cfg: PlannerConfig, snaps) -> list[float]:
    """When the planner answered a predicted OOM (a round, or nodes asked for where none is free)."""
    answers, _ = feed(PlannerPolicy(cfg), snaps)
    return [s.now for s, a in zip(snaps, answers, strict=True) if "OOM predicted" in a.reason]


def test_a_run_started_short_of_its_request_catches_up_inside_the_cooldown_when_it_repays():
    """The cluster had one node free for a job that asked for two; the second comes a minute later.
    Waiting out the cooldown would keep a short job at half its request for its whole run."""
    snaps = [running(t, ["a"], extra=["b"], decided_at=1.0) for t in range(10, 590, 10)]
    rounds = _rounds(CFG, snaps)
    assert rounds, "no catch-up before the cooldown ended"
    now, d = rounds[0]
    assert now < CFG.cooldown_s and set(d.members) == {"a", "b"}
    assert "toward the start size" in d.reason


def test_the_catch_up_is_the_only_decision_that_passes_the_cooldown():
    """The member is a flagged straggler and a healthy node waits: the cooldown lets through the
    catch-up that repays its round, not the straggler's replacement (which waits for the cooldown)."""
    snaps = [running(t, ["a"], extra=["b"], decided_at=1.0) for t in range(10, 590, 10)]
    rounds = _rounds(CFG, snaps, PlannerState(flagged=frozenset({"a"})))
    assert rounds, "no catch-up before the cooldown ended"
    _, d = rounds[0]
    assert set(d.members) == {"a", "b"}
    assert "toward the start size" in d.reason


def test_a_catch_up_that_cannot_repay_its_round_yet_waits_out_the_cooldown():
    """The round was measured to cost 400 s (its members stepped first at t = 400): the ten minutes
    the job has run do not repay another such round, so it waits for the cooldown."""
    snaps = [running(t, ["a"], extra=["b"], decided_at=1.0) for t in range(400, 600, 10)]
    assert not _rounds(CFG, snaps)


def test_an_oom_further_ahead_than_the_job_has_run_waits_for_it_to_come_nearer():
    """The memory reaches the limit (0.9 x 64 GiB) at t = 576: a job that has run 100 s is not raised
    (it may end first); once the limit is no further ahead than the job has run, it is."""
    mem = lambda t: 10.0 + 0.0827 * t  # noqa: E731
    snaps = [running(t, ["a", "b"], max_nodes=2, mem_gib=mem(t)) for t in range(0, 500, 10)]
    acted = _oom_answers(replace(CFG, window=60), snaps)  # the trend spans the whole run
    assert acted, "the OOM was never answered"
    assert acted[0] > 250  # the trend was there from t = 120, 456 s ahead of a job that had run 120 s
    assert 576 - acted[0] <= acted[0]  # answered once the OOM was no further ahead than the run
