"""PlannerState: the windows of observations a pure planner needs, passed in and handed back.

The snapshot carries only the latest metrics; straggler hysteresis, memory trends and per-configuration
step times need a window. ``PlannerPolicy.step(snapshot, state) -> (answer, new_state)`` is a pure function
of its arguments; the caller keeps the state (the leader in memory, or as JSON under its run key so that a
new leader resumes; the simulator per job). :func:`observe` folds one snapshot into the state.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from .history import StartPlan
from .interface import ClusterSnapshot, NodeView


@dataclass(frozen=True)
class NodeSample:
    t: float
    busy_s: (
        float  # the node's own busy time per step (p50; wall time from agents without it), docs/planner.md
    )
    samples_per_s: float
    mem_used: float
    mem_total: float
    cpu_used: float  # cores
    gpu_util: float  # mean over GPUs, -1 when none
    throttled: bool
    step_s: float = 0.0  # the node's step time (p50 wall time); 0: not reported


@dataclass(frozen=True)
class ConfigSample:
    """Job-level step time measured while a given round ran."""

    t: float
    round: int
    world: int
    capacity: float
    step_s: float
    clean: bool = True  # no member was slower than straggler_k x median when it was taken


@dataclass(frozen=True)
class Advice:
    """Resources the planner wants (target node count and per-node budgets); 0 = no opinion."""

    target_nodes: int = 0
    cpu_per_node: float = 0.0
    mem_per_node_bytes: float = 0.0
    reason: str = ""


@dataclass(frozen=True)
class PlannerState:
    nodes: dict[str, tuple[NodeSample, ...]] = field(default_factory=dict)
    configs: tuple[ConfigSample, ...] = ()
    slow: dict[str, int] = field(default_factory=dict)  # >0 consecutive slow samples, <0 fast while flagged
    flagged: frozenset[str] = frozenset()
    last_round_at: float = float("-inf")
    last_round_number: int = -1
    round_seen_at: float = float("-inf")  # when the current round was first seen
    # when every member of the current round first reported steps (its workers started; +inf until then):
    # warm-ups count from here, since starting workers can take longer than any fixed allowance
    round_active_at: float = float("-inf")
    probed: frozenset[int] = frozenset()  # world sizes tried
    start: StartPlan | None = None  # stage 1, once computed
    advice: Advice = Advice()
    peak_mem: float = 0.0
    peak_cpu: float = 0.0
    decisions: int = 0
    last_sample_at: float = float("-inf")
    decided_on_round: int = -2  # the round number our last Decision replaced (pending until it changes)
    ooms_seen: int = 0
    pending: tuple = ()  # (members, standby) of our last Decision
    mem_asked: float = 0.0  # the per-node memory our last resize asked for (0: none pending)
    mem_asked_from: float = 0.0  # the members' memory when the memory rule asked for that raise
    cpu_asked: float = 0.0  # the per-node cores our last resize for starved nodes asked for (0: none)
    growth_total: float | None = None  # job-wide memory growth (bytes/s over all members), once measured
    # the smallest size past which added nodes were measured not to pay (scaling.observed_cap), 0: none;
    # kept for the run, so a later measurement of the smaller size alone (a busier machine) cannot
    # bring back a refuted scale-up
    measured_cap: int = 0
    queued_at: float = float("-inf")  # when a snapshot last said other jobs wait (waiting_nodes > 0)
    # the fewest nodes the job's memory fits on, learnt from an OOM after a memory raise the node took only
    # in part, with no node to add (memory_rules.py): the run is suspended until that many are there; 0: none
    fit_nodes: int = 0
    mem_reasks: int = 0  # memory raises asked again after one did not take (memory_rules.py)
    # lent nodes given back to the queue that still waits for them (lending.py), and the waiting node count
    # they answered: the queue key stays up until the waiting job starts, and those nodes already answer it
    given_back: int = 0
    given_back_for: int = 0
    # the promise (promise.py): when the first round was decided; the last measured round downtimes (from
    # a round's decision to every member stepping); the size and rate before our last stage-2 move, until
    # the new size is judged; the sizes a stop-loss refuted; the seconds exploration has cost so far
    first_round_at: float = float("inf")
    downtimes: tuple[float, ...] = ()
    moved_from: tuple = ()
    bad_worlds: frozenset[int] = frozenset()
    explored_s: float = 0.0
    # a slow warm-up the run's rounds showed (see drop_warmup): how long after every member stepped the
    # rate stopped rising, and the seconds of steady training it cost; 0 until one showed
    warmup_s: float = 0.0
    warmup_loss_s: float = 0.0


def node_capacity(node: NodeView) -> float:
    """Compute capacity in model units: GPUs, or cores/16 on CPU-only nodes."""
    if node.gpu_count > 0:
        return float(node.gpu_count)
    return max(node.cpu_count, 1) / 16.0


def _sample(node: NodeView, now: float) -> NodeSample | None:
    m = node.metrics
    if m is None or m.steps is None or m.steps.steps <= 0:
        return None
    reported = m.gpu_util_known or (True,) * len(m.gpu_util)
    known = [u for u, ok in zip(m.gpu_util, reported, strict=False) if ok]  # MIG reports none: not idle
    gpu = sum(known) / len(known) if known else -1.0
    return NodeSample(
        t=now,
        busy_s=m.steps.p50_s if m.steps.busy_p50_s is None else m.steps.busy_p50_s,
        samples_per_s=m.steps.samples_per_s,
        mem_used=float(m.mem_used_bytes),
        mem_total=float(m.mem_total_bytes or node.mem_total_bytes),
        cpu_used=m.cpu_util * max(node.cpu_count, 1),
        gpu_util=gpu,
        throttled=m.gpu_throttled,
        step_s=m.steps.p50_s,
    )


def reference_busy(busy: list[float], k: float) -> float:
    """The busy time a node is compared with: the members' median, unless more than a quarter of them (two
    or more) are slower than k x it. Such a class is the job's hardware mix (PAI's job 4: two classes
    ~4x apart, replaced by nothing better), not a straggler: the reference is then the slower half's
    median, so that a node far slower than its own class is still found. Of two nodes, the faster one's:
    their median is their mean, against which a node is slow only past 3x the other (k = 1.5)."""
    ordered = sorted(busy)
    if len(ordered) == 2:
        return ordered[0]
    med = statistics.median(ordered)
    slow = sum(b > k * med for b in ordered)
    if slow >= 2 and slow > len(ordered) / 4:
        return statistics.median(ordered[len(ordered) // 2 :])
    return med


def slow_bar(ref: float, steps: list[float], k: float, min_share: float) -> float:
    """The busy time past which a node is slow: ``k`` x the reference, and at least the reference plus
    ``min_share`` of the members' median step time (``steps``). Busy time includes waiting for a CPU: on a
    step spent mostly asleep or in I/O, its few milliseconds double on a loaded machine without the node
    being any slower, and only a gap that shows in the step time is one worth a replacement."""
    return max(k * ref, ref + min_share * statistics.median(steps)) if steps else k * ref


def step_times(samples) -> list[float]:
    """Each node's step time, its busy time where the agent reported none (then they are the same)."""
    return [s.step_s if s.step_s > 0 else s.busy_s for s in samples]


def warmed_up(state: PlannerState, now: float, warmup_s: float) -> bool:
    """Whether the current round's workers have run ``warmup_s`` since they all reported steps."""
    return now >= state.round_active_at + warmup_s


def observe(
    snapshot: ClusterSnapshot,
    state: PlannerState,
    sample_interval_s: float,
    window: int,
    straggler_k: float = 1.5,
    warmup_s: float = 0.0,
    clean_apart: bool = True,
    straggler_min_share: float = 0.0,
    learn_warmup_s: float = 0.0,
) -> PlannerState:
    """Record one sample per node and one job-level step time, at most once per interval.

    Job-level step times are recorded only ``warmup_s`` after every member first reported steps in this
    round (and not in the round's first interval), so each configuration is judged on steady steps only;
    with ``learn_warmup_s`` > 0, at least as long as the run's rounds were seen to warm up, up to that
    long (drop_warmup).
    """
    now = snapshot.now
    cur = snapshot.current
    alive = {n.node_id: n for n in snapshot.nodes}
    new = replace(state, nodes={k: v for k, v in state.nodes.items() if k in alive})
    if cur and cur.number != state.last_round_number:
        began = cur.decided_at if cur.decided_at > 0 else now  # the first round this planner knows of
        new = replace(
            new,
            first_round_at=min(new.first_round_at, began),
            last_round_number=cur.number,
            round_seen_at=now,
            round_active_at=float("inf"),
            probed=new.probed | {len(cur.members)},
        )
    if now - state.last_sample_at < sample_interval_s:
        return new
    nodes = dict(new.nodes)
    peak_mem, peak_cpu = new.peak_mem, new.peak_cpu
    members = set(cur.members) if cur else set()
    for nid, node in alive.items():
        s = _sample(node, now)
        if s is None:
            continue
        nodes[nid] = (nodes.get(nid, ()) + (s,))[-window:]
        if nid in members:
            peak_mem = max(peak_mem, s.mem_used)
            peak_cpu = max(peak_cpu, s.cpu_used)
    new = replace(new, nodes=nodes, peak_mem=peak_mem, peak_cpu=peak_cpu, last_sample_at=now)
    if cur and cur.members and new.round_active_at == float("inf"):
        if all(m in nodes and nodes[m][-1].t == now for m in cur.members):
            began = cur.decided_at if cur.decided_at > 0 else new.round_seen_at
            new = replace(new, round_active_at=now, downtimes=(new.downtimes + (max(now - began, 0.0),))[-4:])
    warm = max(warmup_s, new.warmup_s) if learn_warmup_s > 0 else warmup_s
    if cur and cur.members and now - new.round_seen_at >= sample_interval_s and warmed_up(new, now, warm):
        latest = [nodes[m][-1] for m in cur.members if m in nodes]
        if len(latest) == len(cur.members) and all(s.t == now for s in latest):
            tp = sum(s.samples_per_s for s in latest)
            batch = float(snapshot.job.get("global_batch", 0) or 0)
            if tp > 0 and batch > 0:
                cap = sum(node_capacity(alive[m]) for m in cur.members) / len(cur.members)
                busy = [s.busy_s for s in latest]  # as the straggler detector judges them
                ref = reference_busy(busy, straggler_k)
                bar = slow_bar(ref, step_times(latest), straggler_k, straggler_min_share)
                clean = not any(s.throttled for s in latest) and max(busy) <= bar
                cs = ConfigSample(now, cur.number, len(cur.members), cap, batch / tp, clean)
                if learn_warmup_s > 0 and clean:
                    new = drop_warmup(new, cs, learn_warmup_s)
                new = replace(new, configs=keep_configs(new.configs + (cs,), clean_apart=clean_apart))
    return new


WARMUP_JUMP = 1.6  # a round's rate this much above all its earlier samples: a warm-up, not noise


def drop_warmup(state: PlannerState, cs: ConfigSample, longest_s: float) -> PlannerState:
    """A round whose earlier samples were all slower than ``cs`` by more than WARMUP_JUMP, within
    ``longest_s`` of its start, was warming up (caches, input pipelines, compilation: minutes at a
    fraction of the pace): those samples are not the size's rate. They are dropped, and the run learns how
    long its rounds warm up (later rounds are sampled only after that) and what a warm-up costs
    (promise.round_cost counts it in every round). A rise later in a round is the job changing (its data),
    not a warm-up: nothing is dropped."""
    before = [c for c in state.configs if c.round == cs.round and c.clean]
    took = max(cs.t - state.round_active_at, 0.0)
    if not before or took > longest_s or any(c.step_s <= WARMUP_JUMP * cs.step_s for c in before):
        return state
    slow = statistics.median(c.step_s for c in before)
    loss = took * (1 - cs.step_s / slow)
    return replace(
        state,
        configs=tuple(c for c in state.configs if not (c.round == cs.round and c.clean)),
        warmup_s=max(state.warmup_s, took),
        warmup_loss_s=max(state.warmup_loss_s, loss),
    )


def keep_configs(
    configs: tuple[ConfigSample, ...], per_world: int = 8, clean_apart: bool = True
) -> tuple[ConfigSample, ...]:
    """The latest ``per_world`` clean samples of every world size measured, and as many unclean ones: a
    size measured once is remembered for the whole run (a window over the latest samples forgot it, and the
    model then predicted the same refuted gain again: the scale-up, measure, take back, scale-up
    oscillation), and a straggler episode's unclean samples never push out a size's clean measurement
    (``clean_apart``; the Optimus-style baseline, which has no notion of stragglers, keeps one window)."""
    seen: dict[tuple[int, bool], int] = {}
    kept = []
    for c in reversed(configs):
        key = (c.world, c.clean or not clean_apart)
        seen[key] = seen.get(key, 0) + 1
        if seen[key] <= per_world:
            kept.append(c)
    return tuple(reversed(kept))
