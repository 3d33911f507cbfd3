"""The simulator: jobs arrive, queue, run on node slices, meet stragglers, failures and OOM, and finish.

Cluster admission, the same for every policy: jobs queue FIFO with backfilling, in two passes per tick.
First every queued job whose whole start size fits starts (static's backfill); then, on what is left, an
elastic job starts when its minimum fits. An early start below the start size thus never takes the nodes
a later job would have started on at its own size: static's backfill starts that job at once, and a
well-sized job should not wait longer for the elastic one's sake. While any job waits, a running job gets
nodes only up to what its user requested (replacements), so elastic growth uses capacity nobody else is
waiting for.

The call-in ablations (``ours-call-in``, ``ours-fixed-size-call-in``) model ``erm launch --slurm
--call-in`` (elastic_rm.launch.slurm_call_in): an early start below the start size borrows nodes that a
job arriving later would have backfilled onto under static. Between the two passes, a queued job whose
whole start size would fit on the free nodes plus those of running jobs that started short before it
arrived calls them in (all of a lender's nodes; live, only those the caller needs): those jobs stop
(drained, their progress kept as by a final checkpoint), queue again ahead of the others (live, their new
node jobs queue behind the jobs submitted meanwhile), and resume through the usual passes; each job is
called in at most once.

Time advances in fixed ticks (default 60 s); arrivals, node failures and straggler episodes are events
drawn from one seeded numpy Generator when a slice is created, so a run is reproducible. Every policy sees
the same trace and the same per-job random streams (seeded by job id), so differences come from
decisions, not from luck. Policies act through the RoundPolicy contract: the simulator builds a
ClusterSnapshot per job every ``policy_every`` ticks and applies Decisions as rounds.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import replace

import numpy as np

from ..baselines import OptimusPolicy, StaticPolicy
from ..config import PlannerConfig
from ..interface import ClusterSnapshot, Decision, NodeMetrics, NodeState, NodeView, RoundView, StepStats
from ..job import parse_job
from ..policy import PlannerPolicy
from ..state import Advice
from . import worker_noise
from .cluster import GIB, Cluster, ClusterSpec
from .model import Instability, SimJob, SimNode, sim_planner_config
from .trace import TraceJob
from .truth import hurt, mem_used, step

POLICIES = ("static", "optimus", "ours")
ABLATIONS = ("ours-fixed-size", "ours-no-queue", "ours-call-in", "ours-fixed-size-call-in")
# our planner with the user's per-node CPU and memory; told nothing of the cluster's queue (waiting_nodes
# None); and either of the first two with early starts called in by later jobs (the module docstring)


class Simulator:
    def __init__(
        self,
        jobs: list[TraceJob],
        spec: ClusterSpec,
        policy: str,
        seed: int,
        inst: Instability | None = None,
        tick_s: float = 60.0,
        policy_every: int = 2,
        config: PlannerConfig | None = None,
        horizon_s: float = 60 * 86400.0,
    ) -> None:
        if policy not in POLICIES + ABLATIONS:
            raise ValueError(f"unknown policy {policy!r}; one of {POLICIES + ABLATIONS}")
        self.planner = policy.startswith("ours")
        # the cluster applies the planner's per-node budgets
        self.sizes = policy in ("ours", "ours-no-queue", "ours-call-in")
        self.call_in = policy.endswith("-call-in")
        self.spec, self.policy, self.seed = spec, policy, seed
        self.inst = inst or Instability()
        self.tick, self.every, self.horizon = tick_s, policy_every, horizon_s
        self.config = config or sim_planner_config()
        self.cluster = Cluster(spec)
        self.jobs = [SimJob(j, np.random.default_rng([seed, zlib.crc32(j.job_id.encode())])) for j in jobs]
        self.history: dict[str, list[dict]] = {}
        self.arrivals = 0
        self.waiting = 0  # nodes the queued jobs asked for (ClusterSnapshot.waiting_nodes)
        self.timeline: list[tuple[float, float, float, float, int, int]] = []

    # ----- node slices -----
    def _size(self, job: SimJob) -> tuple[float, float]:
        t = job.trace
        cpu, mem = t.req_cpu_per_node, t.req_mem_gib_per_node * GIB
        if self.sizes:
            a = job.pstate.advice
            cpu = a.cpu_per_node or cpu
            mem = a.mem_per_node_bytes or mem
        return min(max(cpu, 1.0), self.spec.cores), min(mem, self.spec.mem_gib * GIB)

    def _add_node(self, job: SimJob, now: float) -> bool:
        cpu, mem = self._size(job)
        machine = self.cluster.allocate(cpu, mem, job.trace.gpus_per_node)
        if machine is None:
            return False
        r, i = job.rng, self.inst
        self.arrivals += 1
        strag_at = (
            now + r.exponential(3600.0 / i.straggler_per_node_h) if i.straggler_per_node_h > 0 else math.inf
        )
        node = SimNode(
            id=f"{job.trace.job_id}-n{self.arrivals}",
            arrival=self.arrivals,
            machine=machine,
            cpu=cpu,
            mem=mem,
            gpus=job.trace.gpus_per_node,
            seen_at=now,
            fail_at=now + r.exponential(3600.0 / i.fail_per_node_h) if i.fail_per_node_h > 0 else math.inf,
            strag_at=strag_at,
            strag_until=strag_at + r.exponential(i.straggler_mean_h * 3600.0),
            strag_factor=float(r.uniform(*i.straggler_slowdown)),
            strag_throttle=bool(r.uniform() < i.throttle_share),
        )
        job.nodes[node.id] = node
        return True

    def _drop_node(self, job: SimJob, nid: str) -> None:
        n = job.nodes.pop(nid)
        self.cluster.release(n.machine, n.cpu, n.mem, n.gpus)

    def _bounds(self, job: SimJob) -> tuple[int, int]:
        t = job.trace
        return (t.req_nodes, t.req_nodes) if self.policy == "static" else (t.req_min_nodes, t.req_max_nodes)

    def _target(self, job: SimJob) -> int:
        lo, hi = self._bounds(job)
        if self.policy == "static":
            return hi
        want = job.pstate.advice.target_nodes or job.trace.req_nodes
        return min(max(want, lo), hi + self._spares(job))

    def _spares(self, job: SimJob) -> int:
        return sum(1 for m in job.members if m in job.pstate.flagged)

    # ----- the loop -----
    def run(self) -> list[SimJob]:
        pending = sorted(self.jobs, key=lambda j: j.trace.submit_s)
        queue: list[SimJob] = []
        running: list[SimJob] = []
        now, k, nxt = 0.0, 0, 0
        while now < self.horizon and (nxt < len(pending) or queue or running):
            while nxt < len(pending) and pending[nxt].trace.submit_s <= now:
                j = pending[nxt]
                j.policy = self._make_policy()
                nxt += 1
                if self._never_fits(j):
                    j.status, j.reason, j.end_s = "rejected", "does not fit the empty cluster", now
                    continue
                queue.append(j)
            for j in list(running):
                self._advance(j, now)
                if j.status != "running":
                    running.remove(j)
                    self._finish(j)
                elif k % self.every == 0:
                    self._policy_tick(j, now)
            for whole in (True, False) if self.policy != "static" else (True,):
                for j in list(queue):
                    if self._try_start(j, now, whole):
                        queue.remove(j)
                        running.append(j)
                        self._policy_tick(j, now)
                if whole and self.call_in:
                    self._call_in(queue, running, now)
            for j in running:
                want = self._target(j) - len(j.nodes)
                if queue:  # beyond its request a job grows only into capacity nobody waits for
                    want = min(want, j.trace.req_nodes + self._spares(j) - len(j.nodes))
                while want > 0 and self._add_node(j, now):
                    want -= 1
            lent = sum(max(len(j.nodes) - j.trace.req_nodes - self._spares(j), 0) for j in running)
            for j in queue:  # evidence (benchmarks/planner/evidence.py): queueing behind lent nodes
                j.queued_behind_lent_s += lent * self.tick
            for j in running:
                j.peak_lent = max(j.peak_lent, len(j.nodes) - j.trace.req_nodes)
            self.waiting = sum(j.trace.req_nodes for j in queue)  # the queue the next snapshots carry
            self._account(running, now, len(queue))
            now += self.tick
            k += 1
        for j in queue + running:
            j.status, j.reason = "unfinished", "horizon reached"
        return self.jobs

    def _make_policy(self):
        if self.planner:
            return PlannerPolicy(self.config if self.sizes else replace(self.config, resize_rounds=False))
        if self.policy == "optimus":
            return OptimusPolicy(self.config)
        return StaticPolicy()

    def _never_fits(self, job: SimJob) -> bool:
        lo, _ = self._bounds(job)
        cpu, mem = self._size(job)
        return Cluster(self.spec).can_fit_count(cpu, mem, job.trace.gpus_per_node) < lo

    def _start_size(self, job: SimJob, now: float) -> int:
        """The nodes a queued job starts with when they are free (the planner's stage 1 sizes it first)."""
        if self.planner and job.pstate.start is None:
            job.pstate = job.policy.step(self._snapshot(job, now), job.pstate)[1]  # stage 1 only: sizes
        return self._target(job)

    def _try_start(self, job: SimJob, now: float, whole: bool = False) -> bool:
        """Start ``job`` with up to its start size if at least its minimum fits (``whole``: only if all of
        its start size fits, the backfill pass)."""
        lo, _ = self._bounds(job)
        want = self._start_size(job, now)
        need = max(want, lo) if whole else lo
        cpu, mem = self._size(job)
        if self.cluster.can_fit_count(cpu, mem, job.trace.gpus_per_node) < need:
            return False
        while len(job.nodes) < want and self._add_node(job, now):
            pass
        if len(job.nodes) < need:
            for nid in list(job.nodes):
                self._drop_node(job, nid)
            return False
        if math.isnan(job.start_s):  # a first start (not a resume after a call-in)
            job.start_s, job.started_short = now, len(job.nodes) < max(want, lo)
        job.status = "running"
        return True

    def _call_in(self, queue: list[SimJob], running: list[SimJob], now: float) -> None:
        """After the backfill pass: each queued job (in order) whose whole start size fits on the free
        nodes plus those of running jobs that started short before it arrived (newest first, as few as
        it takes) calls them in and starts (the module docstring)."""
        for j in list(queue):
            if j.called_in:  # a job called in waits for the passes, not for others' nodes
                continue
            need = max(self._start_size(j, now), self._bounds(j)[0])
            cpu, mem = self._size(j)
            got = self.cluster.can_fit_count(cpu, mem, j.trace.gpus_per_node)
            if got >= need:
                continue  # it starts in the passes
            lenders = [
                r for r in running if r.started_short and not r.called_in and r.start_s < j.trace.submit_s
            ]
            chosen = []
            for r in sorted(lenders, key=lambda r: -r.start_s):
                if got >= need:
                    break
                chosen.append(r)
                got += len(r.nodes)  # the same node slices (an approximation where sizes differ)
            if got < need or not chosen:
                continue
            for r in chosen:
                for nid in list(r.nodes):
                    self._drop_node(r, nid)
                r.members, r.standby, r.status, r.called_in = [], [], "queued", True
                running.remove(r)
                queue.insert(0, r)
                if len(r.decisions) < 50:
                    r.decisions.append(f"{now:.0f}s: called in by {j.trace.job_id}")
            if self._try_start(j, now, whole=True):
                queue.remove(j)
                running.append(j)
                self._policy_tick(j, now)

    def _crash(self, job: SimJob, now: float) -> None:
        """Workers died: lose training since the last checkpoint, restart."""
        lost = float(job.rng.uniform(0, self.inst.ckpt_interval_s)) * job.last_tp
        job.progress = max(job.progress - lost, 0.0)
        job.pause_until = now + self.tick + self.inst.restart_s  # this tick was already simulated
        job.round_started = job.pause_until  # restarted workers warm up again

    def _advance(self, job: SimJob, now: float) -> None:
        t, dt = job.trace, self.tick
        for nid in [n for n, node in job.nodes.items() if node.fail_at <= now]:
            was_member = nid in job.members
            self._drop_node(job, nid)
            if nid in job.standby:
                job.standby.remove(nid)
            if was_member:
                job.members = [m for m in job.members if m != nid]
                self._crash(job, now)
                job.round_lost = True
        if job.round_lost or not job.members or now < job.pause_until:
            job.last_cpu = 0.0
            return
        ms = [job.nodes[m] for m in job.members]
        slow = [n.slowdown(now) for n in ms]
        if t.worker_noise:
            slow = [s * x for s, x in zip(slow, worker_noise.draw(job.rng, len(ms)), strict=True)]
        st = step(hurt(t, job.progress / t.work_samples), slow, [n.cpu for n in ms])
        noise = float(job.rng.lognormal(0.0, t.step_cv))
        warm = 2.0 if now < job.round_started + t.warmup_s else 1.0  # a slow warm-up: half speed
        tp = t.global_batch / (st.step_s * noise * warm)
        run_s = min(dt, max(now + dt - job.pause_until, 0.0))
        job.last_tp, job.last_cpu = tp, max(st.cpu_used)
        job.peak_cpu = max(job.peak_cpu, job.last_cpu)
        job.step = st
        new_progress = job.progress + tp * run_s
        mem = mem_used(t, len(ms), new_progress / t.work_samples)
        t0, m0, _, _ = job.round_mem
        job.round_mem = (t0, m0, now, mem) if m0 else (now, mem, now, mem)
        if mem > min(n.mem for n in ms):
            job.ooms += 1
            job.reason = f"OOM ({mem / GIB:.1f} GiB > {min(n.mem for n in ms) / GIB:.1f} GiB)"
            if job.ooms > self.inst.max_restarts:
                job.status, job.end_s = "failed", now
                job.reason += f", more than {self.inst.max_restarts} restarts"
                return
            job.progress = new_progress
            self._crash(job, now)
            return
        if t.error_at_frac and new_progress >= t.error_at_frac * t.work_samples > job.progress:
            job.status, job.end_s, job.reason = "failed", now, "non-resource error (data, NaN)"
            return
        if new_progress >= t.work_samples:
            job.end_s = now + (t.work_samples - job.progress) / tp
            job.progress, job.status, job.reason = t.work_samples, "completed", "done"
            return
        job.progress = new_progress

    def _snapshot(self, job: SimJob, now: float) -> ClusterSnapshot:
        t = job.trace
        lo, hi = self._bounds(job)
        views = []
        st = job.step
        running = not job.round_lost and now >= job.pause_until and st is not None
        frac = job.progress / t.work_samples
        member_mem = mem_used(t, max(len(job.members), 1), frac)
        idx = {m: i for i, m in enumerate(job.members)}
        for n in sorted(job.nodes.values(), key=lambda n: n.arrival):
            i = idx.get(n.id)
            if i is not None and running and i < len(st.busy_s):
                used, cpu = member_mem, st.cpu_used[i]
                steps = StepStats(  # the synchronous wall step, and the node's own busy time
                    st.step_s, st.step_s * 1.05, job.last_tp / len(job.members), 100, busy_p50_s=st.busy_s[i]
                )
                gpu = (st.gpu_util[i],) * n.gpus
            else:
                used, cpu, steps, gpu = (
                    (member_mem if i is not None else t.mem_overhead_gib * GIB),
                    0.1,
                    None,
                    (0.0,) * n.gpus,
                )
            metrics = NodeMetrics(
                cpu_util=min(cpu / n.cpu, 1.0),
                mem_used_bytes=int(used),
                mem_available_bytes=int(max(n.mem - used, 0)),
                mem_total_bytes=int(n.mem),
                gpu_util=gpu,
                gpu_throttled=n.strag_throttle and n.slowdown(now) > 1,
                steps=steps,
            )
            views.append(
                NodeView(
                    n.id,
                    n.arrival,
                    n.seen_at,
                    NodeState.ACTIVE,
                    cpu_count=max(int(n.cpu), 1),
                    mem_total_bytes=int(n.mem),
                    gpu_count=n.gpus,
                    metrics=metrics,
                )
            )
        current = None
        if job.round >= 0:
            members = tuple(job.last_members)
            current = RoundView(job.round, members, tuple(job.standby), job.decided_at)
        jd = t.job_dict()
        jd["oom_count"] = job.ooms
        history = (
            tuple(r for r in self.history.get(t.name, []) if r["finished_at"] <= now) if self.planner else ()
        )
        waiting = None if self.policy == "ours-no-queue" else self.waiting
        return ClusterSnapshot(now, lo, hi, 30.0, tuple(views), current, jd, history, waiting)

    def _policy_tick(self, job: SimJob, now: float) -> None:
        if job.status != "running":
            return
        snap = self._snapshot(job, now)
        if isinstance(job.policy, StaticPolicy):
            answer = job.policy.decide(snap)
        else:
            answer, job.pstate = job.policy.step(snap, job.pstate)
        if isinstance(answer, Decision):
            self._apply(job, answer, now)
        self._release_surplus(job)

    def _apply(self, job: SimJob, d: Decision, now: float) -> None:
        alive = set(job.nodes)
        assert set(d.members) <= alive, "a policy chose a node that is not alive"
        job.members, job.standby = list(d.members), list(d.standby)
        job.last_members = list(d.members)
        job.round += 1
        job.rounds += 1
        job.round_lost = False
        job.decided_at = now
        job.pause_until = now + self.tick + self.inst.restart_s  # the round starts after this tick
        job.round_started = job.pause_until
        job.round_mem = (0.0, 0.0, 0.0, 0.0)
        if len(job.decisions) < 50:
            job.decisions.append(f"{now:.0f}s: {d.reason}")
        for nid in list(job.nodes):
            if nid not in d.members and nid not in d.standby:
                self._drop_node(job, nid)
        if self.sizes:
            self._resize(job, job.pstate.advice)

    def _resize(self, job: SimJob, a: Advice) -> None:
        for nid in job.members:
            n = job.nodes[nid]
            cpu = min(max(a.cpu_per_node, 1.0), self.spec.cores) if a.cpu_per_node else n.cpu
            mem = min(a.mem_per_node_bytes, self.spec.mem_gib * GIB) if a.mem_per_node_bytes else n.mem
            if (cpu, mem) == (n.cpu, n.mem):
                continue
            if self.cluster.resize(n.machine, (n.cpu, n.mem), (cpu, mem)):
                n.cpu, n.mem = cpu, mem
                continue
            # migrate the slice (same node id, a new container)
            moved = self.cluster.allocate(cpu, mem, n.gpus)
            if moved is not None:
                self.cluster.release(n.machine, n.cpu, n.mem, n.gpus)
                n.machine, n.cpu, n.mem = moved, cpu, mem

    def _release_surplus(self, job: SimJob) -> None:
        if job.round < 0:
            return
        extra = sorted(
            (n for n in job.nodes.values() if n.id not in job.members and n.id not in job.standby),
            key=lambda n: -n.arrival,
        )
        surplus = len(job.nodes) - max(self._target(job), len(job.members) + len(job.standby))
        for n in extra[: max(surplus, 0)]:
            self._drop_node(job, n.id)

    def _finish(self, job: SimJob) -> None:
        for nid in list(job.nodes):
            self._drop_node(job, nid)
        if not self.planner or job.round < 0:
            return
        t0, m0, t1, m1 = job.round_mem
        growth = (m1 - m0) / (t1 - t0) if t1 > t0 else 0.0
        spec = parse_job(job.trace.job_dict())
        f = job.policy.fit(job.pstate, spec)
        rec = {
            "v": 1,
            "signature": "",
            "run_id": job.trace.job_id,
            "finished_at": job.end_s,
            "status": {
                "completed": "completed",
                "failed": "oom" if job.reason.startswith("OOM") else "failed",
            }.get(job.status, "failed"),
            "world_size": max(len(job.last_members), 1),
            "capacity": float(job.trace.gpus_per_node),
            "throughput": job.last_tp,
            "cpu_per_node_used": job.peak_cpu,
            "mem_per_node_peak_bytes": max(m1, m0),
            "mem_growth_bytes_per_s": growth,
            "coef": list(f.coef) if f else [],
            "duration_s": job.end_s - job.start_s,
        }
        rec["signature"] = spec.signature()
        self.history.setdefault(job.trace.name, []).append(rec)

    def _account(self, running: list[SimJob], now: float, queued: int) -> None:
        dt = self.tick
        ca = cu = ma = mu = ga = gb = 0.0
        for j in running:
            active = j.members and not j.round_lost and now >= j.pause_until
            st = j.step
            mem_m = mem_used(j.trace, max(len(j.members), 1), j.progress / j.trace.work_samples)
            idx = {m: i for i, m in enumerate(j.members)}
            u = j.usage
            j.node_s += len(j.nodes) * dt
            for n in j.nodes.values():
                i = idx.get(n.id)
                cpu_u = st.cpu_used[i] if active and st and i is not None and i < len(st.cpu_used) else 0.1
                gpu_b = (
                    st.gpu_util[i] * n.gpus
                    if active and st and i is not None and i < len(st.gpu_util)
                    else 0.0
                )
                mem_u = mem_m if i is not None else j.trace.mem_overhead_gib * GIB
                vals = (n.cpu, cpu_u, n.mem, min(mem_u, n.mem), float(n.gpus), gpu_b)
                for x in range(6):
                    u[x] += vals[x] * dt
                ca, cu, ma, mu, ga, gb = (
                    ca + n.cpu,
                    cu + cpu_u,
                    ma + n.mem,
                    mu + min(mem_u, n.mem),
                    ga + n.gpus,
                    gb + gpu_b,
                )
        tc, tm, tg = self.spec.total
        if int(now) % 600 == 0:
            self.timeline.append((now, ca / tc, ma / tm, ga / tg, len(running), queued))
