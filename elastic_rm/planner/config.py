"""PlannerConfig: every threshold of the three stages, with the defaults and where they come from.

Defaults follow DLRover's open-source constants (github.com/intelligent-machine-learning/dlrover) where one
exists, re-read for synchronous TorchRec training; the others are ours and say so.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class PlannerConfig:
    """Thresholds of :class:`~elastic_rm.planner.policy.PlannerPolicy`. All times are seconds."""

    # --- observation ---
    sample_interval_s: float = 30.0  # at most one recorded sample per node per interval (metrics repeat)
    window: int = 6  # samples kept per node (straggler window, memory trend)
    # --- stage 2: scaling ---
    profiling: bool = True  # judge a configuration only after its profiling window (False: first sample)
    profile_window_s: float = 180.0  # a configuration is judged only after this long (DLRover: 90-300 s)
    min_profile_samples: int = 2  # and after this many job-level samples of it
    min_marginal_gain: float = 0.2  # an added node must bring >= 20% of an average node's throughput
    lent_node_gain: float = 0.2  # ours: beyond the user's requested node count (capacity a shared cluster
    # lends; later arrivals queue behind it) an added node must bring this much of an average node. The
    # default is min_marginal_gain's bar; while jobs queue, queued_node_gain applies (docs/planner.md)
    queued_node_gain: float = 0.75  # ours: while other jobs wait for nodes (snapshot.waiting_nodes > 0), a
    # node past the request must bring this much of an average node, or it is given back to the queue
    queue_memory_s: float = 3600.0  # ours: a cluster whose queue was seen this recently queues: nodes past
    # the request keep the queued_node_gain bar after the queue emptied (later arrivals would wait for them)
    max_step: int = 8  # at most this many nodes added or removed in one round (DLRover: 4-8)
    gain_horizon_s: float = 1800.0  # a change must repay its round cost within this horizon
    round_cost_s: float = 60.0  # expected pause of one round (flash checkpoint, restart, reshard)
    explore_budget_frac: float = 0.0  # ours: when > 0, a size not yet measured is profiled only while what
    # that is expected to cost fits this share of the job's expected remaining time (promise.py). Off by
    # default: it holds back the scale-downs of communication-bound jobs (docs/planner.md, "The promise")
    user_loss_max: float = 0.03  # ours: below the user's requested node count, keep >= 97% of the
    # throughput predicted (and then measured) at the request ("never worse than the user", docs/planner.md)
    probe_one_node: bool = True  # ours: measure one node once when the model cannot rule out that it is
    # faster (communication that vanishes on one node; see probe.py, docs/planner.md)
    probe_comm_factor: float = 2.0  # ours: the probe's optimistic case: collectives this many times
    # slower than wire speed (the prior assumes wire speed, which no collective beats)
    probe_min_gain: float = 0.25  # ours: probe only when one node would then be this much faster
    # --- stage 3: runtime ---
    cooldown_s: float = 300.0  # between planner rounds (DLRover plan interval: 300 s); losses bypass it
    straggler_k: float = 1.5  # a node is slow when its busy time > k x the members' median
    straggler_clear_k: float = 1.2  # and fast again below this (hysteresis)
    straggler_enter: int = 3  # consecutive slow samples to flag a node
    straggler_exit: int = 3  # consecutive fast samples to clear it
    straggler_min_share: float = 0.05  # ours: and slow only when its busy time also exceeds the
    # reference by this share of the members' median step time: on a step spent mostly waiting (sleep, I/O,
    # a shared CPU), a few milliseconds of busy time above a few milliseconds is noise, not a slower node
    low_gpu_util: float = 0.5  # GPU util below this fraction of the members' median counts as slow
    oom_threshold: float = 0.9  # of the node's memory; DLRover's hot-memory threshold
    oom_horizon_s: float = 900.0  # act when the trend crosses the threshold within this horizon
    min_trend_span_s: float = 60.0  # ours: a memory trend through less time than this is noise (GC, copies)
    round_warmup_s: float = 60.0  # ours: a new round's first seconds (workers loading, tables filling,
    # first steps slow) are neither a memory trend nor a straggler; an OOM in them is still handled
    # --- resources (advice to whoever allocates nodes; the simulator applies it) ---
    mem_margin: float = 0.2  # DLRover PS memory margin +20%
    mem_growth_horizon_s: float = 3600.0  # budget memory for this much trend growth
    cpu_margin_frac: float = 0.25  # CPU budget = used x 1.25 + 1 core (DLRover: + 1 core)
    cpu_margin_cores: float = 1.0
    resize_when_saving: float = 0.35  # resize a running job only when it frees >= 35% of a resource
    resize_rounds: bool = False  # emit a same-members round to apply new budgets (only where rounds resize)
    standby_max: int = 1  # healthy non-members kept as standby; the rest are not listed (free to release)
    # --- stage 1: warm start ---
    history_max: int = 20  # most recent records used
    cold_start_nodes: int = 0  # 0: the user's requested node count (clipped to MIN..MAX)
    cold_mem_margin: float = 0.5  # memory model estimate x 1.5 before anything was observed
    cold_overhead_bytes: int = 4 * GIB  # framework + CUDA context + data pipeline per node, assumed
    oom_restart_factor: float = 2.0  # after an OOM, double the memory budget (DLRover; at most +64 GiB)


def config_from_job(job: dict | None, where: str = "job.planner") -> PlannerConfig:
    """The job description's optional ``"planner"`` object overrides these defaults, field by field
    (e.g. ``{"sample_interval_s": 2, "cooldown_s": 20}`` for a short job). Unknown fields and wrong types
    are a ValueError naming the field, so a typo never silently keeps a default."""
    from dataclasses import fields, replace

    overrides = (job or {}).get("planner", {})
    if not isinstance(overrides, dict):
        raise ValueError(f"{where}: expected a JSON object of PlannerConfig fields")
    types = {f.name: f.type for f in fields(PlannerConfig)}
    values = {}
    for name, value in overrides.items():
        if name not in types:
            raise ValueError(f"{where}: unknown field {name!r} (known: {', '.join(sorted(types))})")
        kind = types[name]
        if kind in ("bool", bool):
            if not isinstance(value, bool):
                raise ValueError(f"{where}.{name}: expected true or false, got {value!r}")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e12:
            raise ValueError(f"{where}.{name}: expected a number >= 0, got {value!r}")
        elif kind in ("int", int) and not float(value).is_integer():
            raise ValueError(f"{where}.{name}: expected a whole number, got {value!r}")
        values[name] = int(value) if kind in ("int", int) else value
    return replace(PlannerConfig(), **values)
