"""The user's promise: a job the planner moves from its requested size ends no later than it would have.

These rules guard every move that stage 2 makes on its own initiative (not a lost member, an OOM or a
straggler: those are forced):

- **Payback from measured downtime.** A move is made only when the gain the model is sure of (predicted
  gain less one residual-based standard error, ``Fit.rel_sigma``) repays what a round of this job was
  measured to cost (``PlannerState.downtime_s``: from the round's decision to every member stepping
  again) within the horizon the job has shown it runs: its elapsed time since the first round, at most
  ``gain_horizon_s``. A job whose rounds cost 30 s therefore explores less than one whose rounds cost
  1 s, a job that has run 10 minutes risks only what 10 minutes repay, and a job shorter than that is
  not explored at all.
- **Below the request only when it is faster, unless others wait.** While no job waits for nodes
  (``waiting_nodes`` 0 or unknown, no queue seen for ``queue_memory_s``), a scale-down below the user's
  request must itself pay as above (communication that vanishes); freeing nodes nobody asked for would
  only cost this job.
- **Exploration budget** (with ``explore_budget_frac`` > 0; off by default). A size not yet measured is
  tried only while what that is expected to cost fits what is left of a budget: ``explore_budget_frac``
  of the job's expected remaining time (its run time so far), shrunk by every piece of evidence that the
  request is right (a refuted move, a warm start from runs at the request). The expected cost is a round
  of measured downtime, plus, with the model's error at that size as the share of throughput lost if it
  is wrong, the profiling window at that loss and the round back. A move is charged a round; a refuted
  one also its measured loss and the round back.
- **Stop-loss.** After a move, once the new size is profiled, a measured rate short of the rate measured
  before the move by more than the model's error bound then (twice its relative residual, at least 2%) is
  reverted at once, and that size is not tried again in the run.
Pure: the state comes in and goes out.
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from .config import PlannerConfig
from .history import StartPlan
from .perf_model import Fit
from .state import PlannerState


def round_cost(cfg: PlannerConfig, state: PlannerState) -> float:
    """What one round costs this job: the largest of its recent measured downtimes, or the configured
    estimate before any round was measured, plus the steady training a slow warm-up of its rounds was
    seen to cost (state.drop_warmup)."""
    down = max(state.downtimes) if state.downtimes else cfg.round_cost_s
    return down + state.warmup_loss_s


def horizon(cfg: PlannerConfig, state: PlannerState, now: float) -> float:
    """How long a move has to repay itself: the job's run time so far (it has shown it runs that long),
    at most ``gain_horizon_s``."""
    return min(cfg.gain_horizon_s, max(now - state.first_round_at, 0.0))


def pays(
    cfg: PlannerConfig,
    state: PlannerState,
    now: float,
    fit: Fit | None,
    world: int,
    gain: float,
    rounds: int = 1,
) -> bool:
    """Whether a move to ``world`` with predicted relative ``gain`` repays ``rounds`` rounds within the
    horizon, counting only the gain beyond the model's one-sigma error at that size (a probe, whose gain
    is already the optimistic case, passes ``world`` 0 for no deduction and pays two rounds: there and
    back)."""
    if fit is None:
        return False
    sure = gain - (fit.rel_sigma(world) if world > 0 else 0.0)
    return sure > 0 and sure * horizon(cfg, state, now) > rounds * round_cost(cfg, state) * (1 + sure)


def exploration_cost(cfg: PlannerConfig, state: PlannerState, fit: Fit | None, world: int) -> float:
    """Seconds that profiling ``world`` is expected to cost: the round there, and, if the model is wrong
    by its error at that size, that share of the profiling window and the round back."""
    sigma = min(fit.rel_sigma(world), 1.0) if fit is not None and world > 0 else 1.0
    cost = round_cost(cfg, state)
    return cost + sigma * (cfg.profile_window_s + cost)


def exploration_left(cfg: PlannerConfig, state: PlannerState, now: float, request: int) -> float:
    """Seconds of exploration this job may still spend: ``explore_budget_frac`` of its expected remaining
    time (as long as it has run: a job that ran an hour is expected to run about that much more), over one
    plus the evidence that its size is right (refuted moves, a warm start at the request), less what
    exploring has cost it so far."""
    start = state.start
    warm_here = isinstance(start, StartPlan) and start.warm and start.world == request
    evidence = len(state.bad_worlds) + (state.measured_cap > 0) + warm_here
    elapsed = max(now - state.first_round_at, 0.0)
    return cfg.explore_budget_frac * elapsed / (1 + evidence) - state.explored_s


def may_explore(
    cfg: PlannerConfig, state: PlannerState, now: float, fit: Fit | None, world: int, request: int
) -> bool:
    """Whether a move to ``world`` fits the exploration budget of a job that requested ``request`` nodes
    (a size already measured is not exploration: the model has seen it); always, without a budget."""
    if cfg.explore_budget_frac <= 0 or any(c.world == world and c.clean for c in state.configs):
        return True
    return exploration_cost(cfg, state, fit, world) <= exploration_left(cfg, state, now, request)


def charge(cfg: PlannerConfig, state: PlannerState, world: int) -> PlannerState:
    """A move to ``world`` made: an unmeasured size is charged a round of measured downtime."""
    if any(c.world == world and c.clean for c in state.configs):
        return state
    return replace(state, explored_s=state.explored_s + round_cost(cfg, state))


def error_bound(fit: Fit | None) -> float:
    """The stop-loss's tolerance: twice the model's relative residual, at least 2%."""
    return 2 * max(fit.rel_rmse if fit is not None else 0.0, 0.01)


def measured_rate(state: PlannerState, round_number: int, batch: float) -> float | None:
    """Samples/s measured in a round (median of its clean job-level samples), or None."""
    steps = [c.step_s for c in state.configs if c.round == round_number and c.clean]
    return batch / statistics.median(steps) if steps else None


def stop_loss(cfg: PlannerConfig, state: PlannerState, round_number: int, world: int, batch: float):
    """After a stage-2 move: (the size to go back to, the state) when the new size measured worse than the
    old by more than the error bound the model had when it moved (``moved_from``: a fit that includes the
    contradicting size has large residuals exactly because it was wrong), else (None, the state with the
    move accepted). The refuted size is kept in ``bad_worlds``, and the exploration budget is charged its
    measured loss over the profiling window and the round back."""
    if not state.moved_from:
        return None, state
    old_world, old_rate, bound = state.moved_from
    rate = measured_rate(state, round_number, batch)
    if rate is None:
        return None, state
    state = replace(state, moved_from=())
    if rate < old_rate * (1 - bound):
        lost = (1 - rate / old_rate) * cfg.profile_window_s + round_cost(cfg, state)
        return old_world, replace(
            state, bad_worlds=state.bad_worlds | {world}, explored_s=state.explored_s + lost
        )
    return None, state
