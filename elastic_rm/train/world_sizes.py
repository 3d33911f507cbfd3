"""The world sizes a job may have, from ``ermrun --nnodes MIN:MAX`` and ``--nproc-per-node``, and the
check that a fixed global batch splits evenly over every one of them.

Why at the start: a global batch that one possible world cannot divide would otherwise fail the job in
the middle of the run, at the first round of that size (a node joining), long after the flags said it
could come. The agent passes the range to its workers in ``ERM_NNODES``; under plain torchrun only the
world at hand is known.
"""

from __future__ import annotations

import math
import os

ENV_NNODES = "ERM_NNODES"  # "MIN:MAX" (the agent's --nnodes), set for every worker


def possible_worlds(world: int, env: dict[str, str] | None = None) -> list[int]:
    """Every world size this job may have: the nodes' count from ``ERM_NNODES`` times this node's
    ``LOCAL_WORLD_SIZE`` (every node runs as many workers), plus ``world`` (the one at hand)."""
    env = os.environ if env is None else env
    spec = env.get(ENV_NNODES, "")
    try:
        lo, hi = (int(x) for x in spec.split(":"))
        per_node = int(env.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        return [world]
    if not 1 <= lo <= hi or per_node < 1:
        return [world]
    return sorted({n * per_node for n in range(lo, hi + 1)} | {world})


def check_global_batch(global_batch: int, world: int, env: dict[str, str] | None = None) -> None:
    """ValueError naming the first world that ``global_batch`` does not split over, and the values that
    split over every possible world (the multiples of their least common multiple)."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch <= 0:
        raise ValueError(f"global_batch must be a positive int, got {global_batch!r}")
    worlds = possible_worlds(world, env)
    bad = [w for w in worlds if global_batch % w]
    if not bad:
        return
    step = math.lcm(*worlds)
    below = global_batch // step * step
    near = [v for v in (below, below + step) if v > 0]
    env = os.environ if env is None else env
    source = (
        f"--nnodes {env[ENV_NNODES]} x --nproc-per-node {env.get('LOCAL_WORLD_SIZE')}"
        if len(worlds) > 1
        else "this world"
    )
    raise ValueError(
        f"global_batch {global_batch} does not split over a world of {bad[0]} workers, which this job may "
        f"have ({source}: worlds {', '.join(map(str, worlds))}); values that split over every one are the "
        f"multiples of {step}, e.g. {' or '.join(map(str, near))} (or narrow --nnodes)"
    )
