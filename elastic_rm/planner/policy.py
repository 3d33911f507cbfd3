"""PlannerPolicy: the three stages on top of torch-like membership liveness.

Order of precedence on every call (the first that answers wins):

0. no job model in ``snapshot.job``: plain :class:`MembershipPolicy`;
1. first round: stage 1 (warm start) picks the world size; last-call semantics as torch;
2. a member is lost: at once, survivors (+ healthy waiting nodes back to the old size), if >= MIN,
   else an empty round (suspended, as MembershipPolicy); a member restarted its workers (``joining``
   again after completing the round): the same members again;
3. our previous Decision is not written yet: wait (no duplicate rounds);
4. OOM predicted within the horizon and no further ahead than the job has run, or an OOM happened: more
   nodes (tables shard thinner) or more memory (memory_rules.py);
5. nodes lent past the request while other jobs wait: given back at once (lending.py);
6. cooldown since the last round, unless a run started short of its start size can catch up and that pays;
7. a flagged straggler: replace it by a standby node, or drop it when that pays;
8. stage 2: after the profiling window, fit the model and move to the marginal-gain target;
9. budgets shrink by >= ``resize_when_saving``: a same-members round (only with ``resize_rounds``).

``step(snapshot, state)`` is pure; ``decide(snapshot)`` threads the state internally (RoundPolicy).
"""

from __future__ import annotations

from dataclasses import replace

from .answers import Answer, decide, standby
from .config import PlannerConfig
from .history import HistoryError, StartPlan, parse_record, warm_start
from .interface import ClusterSnapshot, NodeState, NodeView, Wait
from .job import JobSpec, JobSpecError, parse_job
from .lending import reclaim_check, settle_loans
from .membership import MembershipPolicy, eligible_nodes
from .memory_model import estimate_node_memory, rescale_observed
from .memory_rules import oom_check
from .perf_model import Sample
from .probe import one_node_probe
from .promise import charge, error_bound, may_explore, measured_rate, pays, stop_loss
from .resize_rules import resize_check
from .runtime import memory_growth, update_stragglers
from .scaling import Target, budgets, choose_world, fit_configs, memory_floor, observed_cap, user_floor
from .state import Advice, PlannerState, node_capacity, observe


class PlannerPolicy:
    """The DLRover-RM planner for synchronous TorchRec rounds (see module docstring)."""

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self.state = PlannerState()
        self._job: dict = {}

    def decide(self, snapshot: ClusterSnapshot) -> Answer:
        """RoundPolicy: same as :meth:`step`, keeping the state in this object."""
        answer, self.state = self.step(snapshot, self.state)
        self._job = snapshot.job
        return answer

    def model_coef(self) -> tuple[float, ...]:
        """The model's coefficients fitted on this run's measurements so far (() before any): the leader
        records them so that the run's history record carries them to the next run's warm start."""
        try:
            job = parse_job(self._job) if self._job.get("tables") else None
        except JobSpecError:
            return ()
        f = self.fit(self.state, job) if job is not None else None
        return tuple(f.coef) if f is not None else ()

    @property
    def flagged(self) -> frozenset[str]:
        """The nodes flagged as stragglers (a replaced one keeps its flag while it waits as a standby)."""
        return self.state.flagged

    def adopt_flagged(self, nodes: frozenset[str]) -> None:
        """A new leader takes over the flags its predecessor recorded in the round
        (rendezvous/leader.py): without them, its first round after a member's loss would take back
        the straggler it had just replaced."""
        self.state = replace(self.state, flagged=self.state.flagged | nodes)

    def wanted_nodes(self) -> tuple[int, str] | None:
        """The node count the planner advises (for executors that can add or release nodes), or None."""
        a = self.state.advice
        return (a.target_nodes, a.reason) if a.target_nodes > 0 else None

    def step(self, snapshot: ClusterSnapshot, state: PlannerState) -> tuple[Answer, PlannerState]:
        """Pure: the answer and the new state for this snapshot and the old state."""
        cfg = self.config
        try:
            job = parse_job(snapshot.job) if snapshot.job.get("tables") else None
        except JobSpecError:
            job = None
        if job is None:
            return MembershipPolicy().decide(snapshot), state
        prev_sample = state.last_sample_at
        state = observe(
            snapshot,
            state,
            cfg.sample_interval_s,
            cfg.window,
            cfg.straggler_k,
            cfg.round_warmup_s,
            straggler_min_share=cfg.straggler_min_share,
            learn_warmup_s=3 * cfg.profile_window_s,  # a rise later in a round is the data, not a warm-up
        )
        fresh = state.last_sample_at == snapshot.now and prev_sample != snapshot.now
        if (snapshot.waiting_nodes or 0) > 0:  # the cluster queues (None: unknown, as not)
            state = replace(state, queued_at=snapshot.now)
        state = settle_loans(state, snapshot.waiting_nodes or 0)
        if state.start is None:
            start = self._start(snapshot, job)
            state = replace(
                state,
                start=start,
                advice=Advice(start.world, start.cpu_per_node, start.mem_per_node_bytes, start.reason),
            )
        nodes = eligible_nodes(snapshot)
        cur = snapshot.current
        if cur is None or not cur.members:
            return self._first_round(snapshot, state, nodes)
        if fresh:
            slow, flagged = update_stragglers(state, cur.members, snapshot.now, cfg)
            state = replace(state, slow=slow, flagged=flagged)
            g = memory_growth(state, cur.members, cfg)
            if g is not None:  # conservative: the largest growth seen (a restart pause flattens a window)
                state = replace(state, growth_total=max(g * len(cur.members), state.growth_total or 0.0))
        alive = {n.node_id for n in nodes}
        if not state.flagged <= alive:
            state = replace(state, flagged=state.flagged & alive)
        survivors = [m for m in cur.members if m in alive]
        in_round = set(cur.members)
        waiting = [n.node_id for n in nodes if n.node_id not in in_round]
        healthy = [n for n in waiting if n not in state.flagged]
        if len(survivors) < len(cur.members):
            return self._lost(snapshot, state, cur.members, survivors, healthy, waiting)
        by_id = {n.node_id: n for n in nodes}
        rejoining = [
            m for m in cur.members if by_id[m].state == NodeState.JOINING and by_id[m].round == cur.number
        ]
        if rejoining:  # as MembershipPolicy: a member's workers restarted; every member restarts
            reason = f"node(s) {', '.join(rejoining)} restarted their workers"
            rest = self._standby(healthy, state.flagged)
            return decide(replace(state, last_round_at=snapshot.now), cur.number, cur.members, rest, reason)
        if state.decided_on_round == cur.number:
            return Wait(f"round {cur.number + 1} decided, not yet written"), state
        members = tuple(cur.members)
        for check in (self._oom, self._reclaim, self._cooldown, self._straggler, self._scale, self._resize):
            answer, state = check(snapshot, state, job, members, healthy, nodes)
            if answer is not None:
                return answer, state
        return Wait("steady", until=state.last_sample_at + cfg.sample_interval_s), state

    # ----- helpers -----
    def _start(self, snapshot: ClusterSnapshot, job: JobSpec) -> StartPlan:
        records = []
        for i, d in enumerate(snapshot.history):
            try:
                records.append(parse_record(d, f"history[{i}]"))
            except HistoryError:
                continue  # the leader validates and reports; the planner ignores what it cannot read
        waiting = snapshot.waiting_nodes or 0
        return warm_start(job, records, snapshot.min_nodes, snapshot.max_nodes, self.config, waiting)

    def _standby(self, candidates: list[str], flagged: frozenset[str]) -> tuple[str, ...]:
        return standby(candidates, flagged, self.config.standby_max)

    def _first_round(self, snapshot: ClusterSnapshot, state: PlannerState, nodes: list[NodeView]):
        start = state.start
        assert isinstance(start, StartPlan)
        if len(nodes) < snapshot.min_nodes:
            return Wait(f"{len(nodes)} of at least {snapshot.min_nodes} node(s) present"), state
        target = min(max(start.world, snapshot.min_nodes), snapshot.max_nodes)
        fit = state.fit_nodes if state.fit_nodes <= snapshot.max_nodes else 0
        if len(nodes) < fit:  # an OOM on fewer nodes, after a raise they took only in part (memory_rules.py)
            return Wait(
                f"{len(nodes)} node(s) present; the job's memory fits on {fit} (an OOM on fewer)"
            ), state
        target = max(target, fit)
        if len(nodes) < target:
            deadline = nodes[snapshot.min_nodes - 1].seen_at + snapshot.last_call_timeout
            if snapshot.now < deadline:
                return Wait(
                    f"{len(nodes)} node(s) of {target} wanted; last call until {deadline:.3f}", until=deadline
                ), state
        ids = [n.node_id for n in nodes]
        members = ids[:target]
        state = replace(
            state, last_round_at=snapshot.now, first_round_at=min(state.first_round_at, snapshot.now)
        )
        if state.decisions == 0 and len(members) != start.world and start.mem_per_node_bytes > 0:
            job = parse_job(snapshot.job)  # the start budget was for start.world nodes
            oh = self.config.cold_overhead_bytes
            mem = rescale_observed(
                start.mem_per_node_bytes,
                estimate_node_memory(job, start.world, oh),
                estimate_node_memory(job, len(members), oh),
            )
            state = replace(state, advice=replace(state.advice, mem_per_node_bytes=mem))
        reason = f"first round of {len(members)} node(s); {start.reason}"
        number = snapshot.current.number if snapshot.current else -1
        spare = self._standby(ids[target:], state.flagged)
        return decide(state, number, members, spare, reason, None, start.confidence)

    def _lost(self, snapshot, state, old, survivors, healthy, waiting):
        want = min(len(old), snapshot.max_nodes)
        fill = healthy + [n for n in waiting if n not in healthy]
        members = survivors + healthy[: max(want - len(survivors), 0)]
        if len(members) < snapshot.min_nodes:  # a flagged straggler only to keep the job at MIN
            members += [n for n in fill if n not in members][: snapshot.min_nodes - len(members)]
        lost = len(old) - len(survivors)
        if len(members) < snapshot.min_nodes:
            # as MembershipPolicy: an empty round stops the survivors' workers; they wait as standby
            reason = f"{lost} member(s) lost; below {snapshot.min_nodes} node(s), suspended"
            return decide(state, snapshot.current.number, (), tuple(survivors + fill), reason)
        rest = [n for n in fill if n not in members]
        state = replace(state, last_round_at=snapshot.now)
        reason = f"{lost} member(s) lost; continuing with {len(members)}"
        gain = len(members) / len(old) - 1
        spare = self._standby(rest, state.flagged)
        return decide(state, snapshot.current.number, members, spare, reason, gain, 0.9)

    def fit(self, state: PlannerState, job: JobSpec):
        """The model fitted on the clean samples of ``state``, with the warm start's coefficients as its
        prior (None before any sample): what stage 2 decides on and what a finished run records."""
        samples = [Sample(c.world, c.capacity, c.step_s) for c in state.configs if c.clean]
        if not samples:
            return None
        prior = state.start.coef if isinstance(state.start, StartPlan) else ()
        return fit_configs(job, samples, prior)

    def _oom(self, snapshot, state, job, members, healthy, nodes):
        return oom_check(self.config, snapshot, state, job, members, healthy, nodes)

    def _reclaim(self, snapshot, state, job, members, healthy, nodes):
        request = job.request.nodes if job.request else 0
        if not (snapshot.waiting_nodes or 0) > 0 or len(members) <= request:  # nothing lent or nobody asks
            return None, state
        return reclaim_check(self.config, snapshot, state, job, members, healthy, nodes, self.fit(state, job))

    def _cooldown(self, snapshot, state, job, members, healthy, nodes):
        cur = snapshot.current
        last = max(state.last_round_at, cur.decided_at if cur.decided_at > 0 else float("-inf"))
        until = last + self.config.cooldown_s
        if snapshot.now >= until:
            return None, state
        if self._catch_up_pays(snapshot, state, job, members, healthy, nodes):  # the only exception
            return self._catch_up(snapshot, state, members, healthy)
        return Wait(f"cooldown until {until:.3f}", until=until), state

    def _catch_up(self, snapshot, state, members, healthy):
        """A run started short of its start size (a full cluster gave fewer nodes) takes healthy waiting
        nodes up to it as they come, without a profiling window: the start size was planned for the job.
        The cooldown lets this decision, and no other, through when it repays its round."""
        start = state.start
        want = self._start_size(snapshot, state)
        if not (len(members) < want and healthy):
            return None, state
        new = list(members) + healthy[: want - len(members)]
        state = replace(state, last_round_at=snapshot.now)
        reason = f"scale up {len(members)} -> {len(new)}: toward the start size {want} ({start.reason})"
        spare = self._standby(healthy[want - len(members) :], state.flagged)
        return decide(state, snapshot.current.number, new, spare, reason, None, start.confidence)

    @staticmethod
    def _start_size(snapshot, state) -> int:
        """The size a run started short of catches up to: the start size, never past what stage 2 has
        since chosen (standby nodes wait); 0 before a start plan."""
        start = state.start
        want = min(start.world, snapshot.max_nodes) if isinstance(start, StartPlan) else 0
        if state.advice.target_nodes > 0:
            want = min(want, state.advice.target_nodes)
        return want

    def _catch_up_pays(self, snapshot, state, job, members, healthy, nodes) -> bool:
        """Whether a run the cluster started short of its start size gains so much from the nodes now
        free that the round up to it repays itself within the time the job has run (promise.pays): a short
        job would otherwise spend its whole run below its request, waiting out the cooldown."""
        if not isinstance(state.start, StartPlan) or not healthy:
            return False
        want = self._start_size(snapshot, state)
        w = len(members)
        target = min(want, w + len(healthy))
        f = self.fit(state, job)
        if target <= w or f is None:
            return False
        by_id = {n.node_id: n for n in nodes}
        cap = sum(node_capacity(by_id[m]) for m in members) / w
        shape = self._shape(job)
        gain = f.throughput(shape, target, cap) / max(f.throughput(shape, w, cap), 1e-9) - 1
        return pays(self.config, state, snapshot.now, f, target, gain)

    def _straggler(self, snapshot, state, job, members, healthy, nodes):
        cfg = self.config
        bad = [m for m in members if m in state.flagged]
        if not bad:
            return None, state
        f = self.fit(state, job)
        by_id = {n.node_id: n for n in nodes}
        w = len(members)
        obs = [c for c in state.configs if c.round == snapshot.current.number]
        if healthy:
            swap = dict(zip(bad, healthy, strict=False))
            new = [swap.get(m, m) for m in members]
            gain = obs[-1].step_s / f.step_s(self._shape(job), w, obs[-1].capacity) - 1 if f and obs else None
            state = replace(state, last_round_at=snapshot.now)
            reason = f"straggler(s) {', '.join(swap)} replaced by {', '.join(swap.values())}"
            rest = [n for n in healthy if n not in swap.values()]
            spare = self._standby(rest, state.flagged)
            return decide(state, snapshot.current.number, new, spare, reason, gain, 0.7)
        keep = [m for m in members if m not in bad]
        if len(keep) < max(snapshot.min_nodes, 1) or f is None or not obs:
            spares = max(state.advice.target_nodes, w + len(bad))
            state = replace(
                state, advice=replace(state.advice, target_nodes=spares, reason="spare for a straggler")
            )
            return None, state
        cap = sum(node_capacity(by_id[m]) for m in keep) / len(keep)
        gain = f.throughput(self._shape(job), len(keep), cap) / (job.global_batch / obs[-1].step_s) - 1
        if gain * cfg.gain_horizon_s <= cfg.round_cost_s * (1 + gain) or gain < 0.05:
            spares = max(state.advice.target_nodes, w + len(bad))
            state = replace(
                state, advice=replace(state.advice, target_nodes=spares, reason="spare for a straggler")
            )
            return None, state
        state = replace(state, advice=replace(state.advice, target_nodes=max(state.advice.target_nodes, w)))
        state = replace(state, last_round_at=snapshot.now)
        reason = f"straggler(s) {', '.join(bad)} removed; no standby node"
        return decide(state, snapshot.current.number, keep, (), reason, gain, f.confidence(len(keep)))

    @staticmethod
    def _shape(job: JobSpec):
        from .scaling import shape_of

        return shape_of(job)

    def _scale(self, snapshot, state, job, members, healthy, nodes):
        cfg = self.config
        cur = snapshot.current
        ready = [c for c in state.configs if c.round == cur.number and c.clean]
        window, need = (cfg.profile_window_s, cfg.min_profile_samples) if cfg.profiling else (0.0, 1)
        answer, state = self._catch_up(snapshot, state, members, healthy)
        if answer is not None:
            return answer, state
        want = self._start_size(snapshot, state)
        if snapshot.now - state.round_seen_at < window or len(ready) < need:
            until = state.round_seen_at + cfg.profile_window_s
            return Wait(
                f"profiling {len(members)} node(s) ({len(ready)} sample(s))", until=max(until, snapshot.now)
            ), state
        f = self.fit(state, job)
        by_id = {n.node_id: n for n in nodes}
        w = len(members)
        cap = sum(node_capacity(by_id[m]) for m in members) / w
        growth = (state.growth_total or 0.0) / w
        per_node = max(state.nodes[m][-1].mem_used for m in members)
        node_mem = min(state.nodes[m][-1].mem_total for m in members)
        lo, hi = max(snapshot.min_nodes, 1), snapshot.max_nodes
        # a scale-up the memory forces looks as far ahead as the OOM rule (which raises memory first where
        # rounds resize); the budgets' hour-long growth horizon would add nodes to a job that only grows
        soon = replace(cfg, mem_growth_horizon_s=min(cfg.mem_growth_horizon_s, cfg.oom_horizon_s))
        lo_up = max(lo, memory_floor(job, soon, w, per_node, growth, node_mem, lo, hi))
        points = [(c.world, c.step_s) for c in state.configs if c.clean]
        measured = observed_cap(points, cfg.min_marginal_gain)
        if measured is not None and not 0 < state.measured_cap <= measured:
            state = replace(state, measured_cap=measured)
        measured = state.measured_cap or None
        floor, floor_why = self._user_floor(state, job, f, cap, lo, hi, points)
        request = job.request.nodes if job.request else 0
        # the cluster's queue (None: unknown, as none), less the nodes already given back to it (lending.py)
        waiting = max((snapshot.waiting_nodes or 0) - state.given_back, 0)
        queues = snapshot.now - state.queued_at < cfg.queue_memory_s
        args = (cfg, measured, floor, floor_why, request, waiting, queues)
        rate_now = measured_rate(state, cur.number, job.global_batch)
        back, state = stop_loss(cfg, state, cur.number, w, job.global_batch)
        t = choose_world(f, job, cap, w, lo_up, hi, *args)
        strict = replace(cfg, oom_threshold=cfg.oom_threshold * 0.85)
        if t.world < w:  # scaling down needs memory headroom too (hysteresis against OOM-driven scale-ups)
            lo_down = max(lo_up, memory_floor(job, strict, w, per_node, growth, node_mem, lo, hi))
            t = choose_world(f, job, cap, w, min(lo_down, w), hi, *args)
        probe = False
        if lo == 1 and t.world > 1:  # one node measured once, when it may be faster (probe.py)
            fits = memory_floor(job, strict, w, per_node, growth, node_mem, 1, hi) == 1
            p = one_node_probe(cfg, state, job, f, cap, w, t, ready) if fits else t
            gain = p.throughput / max(p.current_throughput, 1e-9) - 1
            probe = p is not t and pays(cfg, state, snapshot.now, f, 0, gain, rounds=2)
            t = p if probe else t
        t = self._promise(state, snapshot.now, f, t, w, back, max(request, lo_up), waiting or queues)
        forced = back is not None or w < lo_up  # a stop-loss or the memory floor: no payback asked
        if t.world > w and not forced:  # ask for nodes only for a move that will be made when they come
            t = self._up_that_pays(state, snapshot, f, job, cap, w, t, request, max(want, w))
        est_w = estimate_node_memory(job, w, cfg.cold_overhead_bytes)
        est_t = estimate_node_memory(job, t.world, cfg.cold_overhead_bytes)
        per_target = max(per_node, rescale_observed(per_node, est_w, est_t))  # budget for both sizes
        cpu_used = max(state.nodes[m][-1].cpu_used for m in members)
        alloc_cpu = min(by_id[m].cpu_count for m in members)
        if t.world < w:  # input-pipeline cores scale with each node's sample rate
            rate = (t.throughput / t.world) / max(t.current_throughput / w, 1e-9)
            cpu_used *= max(rate, 1.0)
        cpu, mem = budgets(cfg, cpu_used, per_target, growth * w / min(t.world, w), alloc_cpu)
        spares = sum(1 for m in members if m in state.flagged)
        floor_mem = state.advice.mem_per_node_bytes if state.ooms_seen else 0
        state = replace(state, advice=Advice(t.world + spares, cpu, max(mem, floor_mem), t.why))
        target = min(t.world, w + len(healthy))
        if target == w:
            return None, state
        gain = t.throughput / t.current_throughput - 1 if target == t.world else None
        if target > w:
            new = list(members) + healthy[: target - w]
            fresh_nodes = [by_id[n] for n in healthy[: target - w]]
            deadline = max(n.seen_at for n in fresh_nodes) + snapshot.last_call_timeout
            if target < t.world and snapshot.now < deadline:
                return Wait(
                    f"scale-up to {t.world} wanted; last call until {deadline:.3f}", until=deadline
                ), state
            pred = f.throughput(self._shape(job), target, cap)
            gain = pred / t.current_throughput - 1
            # a loan past the request pays its way back too, where a queue can call it in (lending.py)
            lends = 2 if 0 < request < target and snapshot.waiting_nodes is not None else 1
            why = t.why
            if not forced and not pays(cfg, state, snapshot.now, f, target, gain, rounds=lends):
                # below the request, the way up to it is no loan: it pays one round on its own
                if not w < request < target:
                    return None, state
                target, why = request, f"up to the request of {request} (past it does not repay two rounds)"
                new = list(members) + healthy[: target - w]
                gain = f.throughput(self._shape(job), target, cap) / t.current_throughput - 1
                if not pays(cfg, state, snapshot.now, f, target, gain, rounds=1):
                    return None, state
            rest = healthy[target - w :]
            reason = f"scale up {w} -> {target}: {why}"
        else:
            new = list(members)[:target]
            rest = [m for m in members[target:]] + healthy
            reason = f"scale down {w} -> {target}: {t.why}"
        if not forced and (gain or 0.0) > 0:  # a move for speed: within the exploration budget
            if not may_explore(cfg, state, snapshot.now, f, target, request):
                return None, state
            state = charge(cfg, state, target)
        expect = back is None and rate_now is not None and (gain or 0.0) > 0  # a move for speed: judged next
        moved = (w, rate_now, error_bound(f)) if expect else ()
        state = replace(state, last_round_at=snapshot.now, moved_from=moved)
        if target < w and waiting > 0:  # the freed nodes answer the queue as a give-back does: not standby
            back_to = snapshot.waiting_nodes or 0
            state = replace(state, given_back=state.given_back + w - target, given_back_for=back_to)
            rest = list(healthy)
        spare = self._standby(rest, state.flagged)
        return decide(state, cur.number, new, spare, reason, gain, t.confidence)

    def _up_that_pays(self, state, snapshot, f, job, cap, w, t, request, hold) -> Target:
        """The size whose nodes a scale-up asks for: the target when the move there repays its rounds
        (past the request two: there and back, where a queue can call the loan in), else the request from
        below when that repays one, else no more than ``hold`` (the current size, or the start size a run
        started short of). The advice is what a launcher starts nodes for (the simulator allocates them):
        nodes asked for a move that is then not made would be held idle while later arrivals queue."""
        cfg, shape, now = self.config, self._shape(job), snapshot.now

        def worth(size: int, rounds: int) -> bool:
            gain = f.throughput(shape, size, cap) / max(t.current_throughput, 1e-9) - 1
            sure = pays(cfg, state, now, f, size, gain, rounds)
            return sure and may_explore(cfg, state, now, f, size, request)

        lends = 2 if 0 < request < t.world and snapshot.waiting_nodes is not None else 1
        if worth(t.world, lends):
            return t
        if w < request < t.world and worth(request, 1):
            why = f"up to the request of {request} (past it does not repay two rounds)"
            return Target(request, f.throughput(shape, request, cap), t.current_throughput, t.confidence, why)
        size = min(t.world, hold)
        why = f"{t.world} node(s) would not repay the rounds the move costs; staying at {size}"
        return Target(size, f.throughput(shape, size, cap), t.current_throughput, t.confidence, why)

    def _promise(self, state, now, f, t, w, back, floor, others_wait) -> Target:
        """promise.py on stage 2's target: a stop-loss goes back; a refuted size is not tried again; below
        the request (or the memory floor) while nobody waits, only a move that pays."""
        if back is not None:
            why = f"stop-loss: {w} node(s) measured below the rate before the move; back to {back}"
            return Target(back, t.current_throughput, t.current_throughput, 1.0, why)
        if t.world != w and t.world in state.bad_worlds:
            return Target(w, t.current_throughput, t.current_throughput, 1.0, f"{t.world} node(s) refuted")
        if t.world < min(w, floor) and not others_wait:
            gain = t.throughput / max(t.current_throughput, 1e-9) - 1
            sigma_world = 0 if t.world == 1 and t.confidence == 0.0 else t.world  # the probe: optimistic
            if not pays(self.config, state, now, f, sigma_world, gain, rounds=1 + (sigma_world == 0)):
                why = "below the request, nobody waits, and the gain does not repay a round"
                return Target(w, t.current_throughput, t.current_throughput, 1.0, why)
        return t

    def _user_floor(self, state, job, f, cap, lo, hi, points) -> tuple[int, str]:
        """The user's rule (scaling.user_floor) around the requested node count, or the warm start's
        size when history chose it; 0 when the job has neither."""
        start = state.start
        ref = start.world if isinstance(start, StartPlan) and start.warm else 0
        ref = ref or (job.request.nodes if job.request else 0)
        if ref <= 0:
            return 0, ""
        ref = min(max(ref, lo), hi)
        return user_floor(f, job, cap, ref, lo, self.config.user_loss_max, points)

    def _resize(self, snapshot, state, job, members, healthy, nodes):
        return resize_check(self.config, snapshot, state, members, healthy, nodes)
