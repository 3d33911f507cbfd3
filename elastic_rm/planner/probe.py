"""Stage 2's one-node probe: measure one node once per run when the model cannot rule out that it is faster.

Why: on one node the all-to-all and the all-reduce vanish, so a communication-bound job can run several
times faster there than on the user's nodes, and no size of two or more shows it (each keeps most of its
collectives). Measured at one size, the model cannot tell compute from communication: its prior puts the
collectives at wire speed, the fastest they can be, which makes one node look slow, and the user's floor
then keeps the job at the request. The probe costs one profiling window and a round each way; the user's
floor (scaling.user_floor, on measured sizes) brings the job back when one node is slower. Pure.
"""

from __future__ import annotations

import statistics

from .config import PlannerConfig
from .job import JobSpec
from .perf_model import Fit, features
from .scaling import Target, shape_of
from .state import ConfigSample, PlannerState


def one_node_gain(
    f: Fit, job: JobSpec, capacity: float, world: int, step_s: float, cfg: PlannerConfig
) -> float:
    """The gain one node would bring in the optimistic case, when it clears ``probe_min_gain``; else 0.

    The optimistic case: collectives ``probe_comm_factor`` times slower than wire speed (or what the fit
    says, if more), and the rest of the measured step, less the fixed part, is compute. A job whose step is
    mostly compute never clears the bar: its compute alone, times ``world``, exceeds the step.
    """
    if world < 2 or step_s <= 0:
        return 0.0
    x = features(shape_of(job), world, capacity)
    a = f.coef
    comm = max(cfg.probe_comm_factor * (x[1] + x[2]), a[1] * x[1] + a[2] * x[2])
    compute = max(step_s - comm - a[3], 0.0)
    gain = float(step_s / max(compute * world + a[3], 1e-9) - 1)
    return gain if gain >= cfg.probe_min_gain else 0.0


def one_node_probe(
    cfg: PlannerConfig,
    state: PlannerState,
    job: JobSpec,
    f: Fit,
    capacity: float,
    world: int,
    target: Target,
    ready: list[ConfigSample],
) -> Target:
    """One node instead of ``target`` (stage 2's choice at ``world`` nodes) when the probe is on, one node
    was neither run nor tried in this run, and it would pay in the optimistic case; else ``target``. The
    caller checks that one node fits in memory. Its predicted gain is the optimistic one, at confidence 0."""
    if not cfg.probe_one_node or world < 2 or 1 in state.probed or not ready:  # probed: every size run
        return target
    step_s = statistics.median(c.step_s for c in ready)
    gain = one_node_gain(f, job, capacity, world, step_s, cfg)
    if gain <= 0:
        return target
    why = (
        f"probe: with collectives at {cfg.probe_comm_factor:g}x wire speed one node would be {gain:.0%} "
        f"faster (measured {step_s:.3f} s a step at {world})"
    )
    return Target(1, target.current_throughput * (1 + gain), target.current_throughput, 0.0, why)
