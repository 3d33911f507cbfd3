"""`erm launch --slurm`: the run's nodes come from Slurm, one one-node job per node, and go back to it.

Slurm cannot grow a running job, so the run grows by jobs of its own: every node is a job named
``erm-<run id>`` (with a comment naming the run) whose batch script execs ``ermrun`` with the run's
rendezvous and the Slurm node's name as ``--node-id``. The executor's rules are those of the hostfile
executor (elastic_rm.launch.executor), over jobs instead of hosts:

- more nodes wanted than running plus pending node jobs: submit one more (never more in flight than
  wanted), excluding the user's ``--exclude`` hosts, blacklisted hosts and hosts whose node id is still
  registered in etcd; a job pending longer than ``pending_report_s`` is reported once with Slurm's reason;
- fewer wanted: pending jobs are cancelled first, then running nodes the round neither uses nor keeps as
  standby get SIGTERM (their agent leaves the rendezvous, the batch script ends, the node is idle);
- a node job that ends while the run is open failed; when Slurm ended it (NODE_FAIL, an admin's cancel)
  or its node is DOWN or DRAIN, its host is blacklisted at once and the replacement excludes it; one that
  reached its own time limit is replaced without blame; one that Slurm suspended is cancelled and
  replaced; after START_FAILURES node jobs in a row that ended before any node of the run registered,
  the executor gives up (exit 1) instead of submitting one a poll;
- no node job is submitted while every node of the run's partitions is excluded (sbatch would refuse it:
  a FAILED job in Slurm's records at every poll); that is said once;
- on start, the run's jobs that Slurm still has (same name and comment) are adopted, not duplicated;
- the run's ``queue`` key gets the nodes that other pending jobs ask for in any partition that shares a
  node with the run's (``waiting_nodes``; at once when it changes, else every few seconds): the planner
  gives nodes back while others wait; and the run's node jobs that Slurm runs (``running_nodes``): the
  leader holds the first round until their agents registered (bounded), so that it does not form without
  them;
- growth yields to other jobs: a node job past the run's request (the job description's, else --nnodes'
  minimum) is submitted with a large ``--nice`` (Slurm starts every other pending job first), and while
  other jobs of the partition wait, no such job is submitted and the pending ones are cancelled. Other
  runs' growth jobs are not counted as waiting (they yield as well);
- with ``--call-in``, a run whose first round had fewer nodes than its request lends them to a job that
  arrived after it (elastic_rm.launch.slurm_call_in): as many of its running node jobs as that job
  needs stop, its pending ones are deferred in their place, none is submitted until that job no longer
  pends (at most CALL_IN_HOLD_S), then the run asks for its nodes again. Once per run.

Size: one executor; its rules read one state of the run and of Slurm's queue at each poll, and split
apart they would pass that state between modules.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from ..etcd.errors import EtcdError
from ..wire.records import QUEUE_WRITE_EVERY_S as QUEUE_EVERY_S
from ..wire.records import ClosedRecord, QueueRecord, RecordError, RoundRecord
from .executor import Executor, RunState, among
from .hostfile import Host
from .interrupts import Interrupts
from .slurm import SlurmError as HostListError
from .slurm import expand_hostlist
from .slurm_call_in import PendingDemand, choose_caller, job_number, pending_demands
from .slurm_cli import BAD_NODE_STATES, NODE_LOST, Slurm, SlurmError, SlurmJob
from .slurm_job import GROWTH_MARK, GROWTH_NICE, SlurmOptions

# the planner's reason for a demand past the round's size that replaces stragglers
# (elastic_rm/planner/policy.py): their nodes go back once replaced, so those node jobs are no growth
STRAGGLER_SPARE = "spare for a straggler"
# the pending reasons (squeue's first word) of a job that waits for nodes, which a node given back may start;
# any other (a dependency, a hold, a start time, a limit, a reservation, a partition down, a bad constraint or
# account, "launch failed requeued held") would not start it. "None": the scheduler has not looked at it yet
WAITING_FOR_NODES = ("Resources", "Priority", "None", "")
# waits for named nodes that are unavailable: waiting for nodes only if it names one of this run's
REQ_NODE_NOT_AVAIL = "ReqNodeNotAvail"
# ends that are the job's own limits (--time, --deadline), not its host's fault: no blacklist
NOT_THE_HOST = frozenset({"TIMEOUT", "DEADLINE"})
# a node job in these states holds its node with its processes stopped (_stop_suspended)
SUSPENDED = frozenset({"SUSPENDED", "STOPPED"})
# node jobs in a row that end before any node of the run registered: erm launch gives up (_gave_up)
START_FAILURES = 5
# how long a run that lent its nodes (--call-in) waits for the job that called them in to start, before
# it asks Slurm for nodes again: that job may need more than the nodes (a constraint, a feature)
CALL_IN_HOLD_S = 120.0


# node names one message or event lists at most (then "and N more"): an event past 16 KiB is refused
NAMED_AT_MOST = 64


def _some(names) -> str:
    """Sorted names, comma-separated, the first NAMED_AT_MOST of them."""
    names = sorted(names)
    more = f" and {len(names) - NAMED_AT_MOST} more" if len(names) > NAMED_AT_MOST else ""
    return ", ".join(names[:NAMED_AT_MOST]) + more


class SlurmNode:
    """One node job: pending, then running on a Slurm node (whose name is the node id), then ended."""

    def __init__(self, job_id: str, state: str = "PENDING", nodes: str = "", growth: bool = False):
        self.job_id = job_id
        self.growth = growth  # past the run's request: niced, cancelled while pending if others wait
        self.state = state
        self.slurm_node = nodes
        self.reason = ""
        self.started_at = time.monotonic()
        self.stop_requested_at: float | None = None
        self.stop_reason = ""
        self.registered = False
        self.pending_reported = False
        self.killed = False
        self.exit_code: int | None = None

    @property
    def node_id(self) -> str:
        return self.slurm_node or f"job-{self.job_id}"

    @property
    def host(self) -> Host:
        return Host(name=self.node_id, addr=self.slurm_node or "-", labels={"slurm_job": self.job_id})

    @property
    def stopping(self) -> bool:
        return self.stop_requested_at is not None

    @property
    def pending(self) -> bool:
        return self.state == "PENDING"


class SlurmExecutor(Executor):
    """The executor over Slurm jobs; ``nodes`` is keyed by job id."""

    def __init__(
        self,
        client,
        keys,
        pool,
        slurm: Slurm,
        options: SlurmOptions,
        events,
        config,
        say,
        partitions: tuple[str, ...],
        clock: Callable[[], float] = time.monotonic,
        interrupts: Interrupts | None = None,
    ):
        super().__init__(client, keys, pool, self._no_host_start, events, config, say, interrupts=interrupts)
        self.slurm, self.options, self.partitions = slurm, options, set(partitions)
        self._clock = clock
        self._queue_at = float("-inf")
        self.waiting_nodes: int | None = None  # as last written to the queue key
        self.running_nodes = 0  # as last written to the queue key
        self.others_waiting = 0  # nodes other pending jobs of the partitions ask for, at the last poll
        self._holding = False  # growth held back because others wait (reported once per hold)
        self._rounds_read = False  # the run's round records, read once it closed (_note_round_members)
        self.submitted = 0
        self._node_names: set[str] | None = None  # every Slurm node's name
        self._ended_ids: set[str] = set()  # our ended nodes' ids, while etcd still lists them (lease)
        self._start_failures: list[str] = []  # node jobs in a row that ended before their agent registered
        # node -> its partitions (sinfo), read once
        self._node_partitions: dict[str, frozenset[str]] | None = None
        self._excluded_said: tuple[str, ...] | None = None  # the exclusions last said to cover them all
        # --call-in: whether the run's first round was short of its request, and the run's oldest node
        # job id then (the jobs after it arrived later); None until that round is seen
        self._first_round: tuple[bool, int] | None = None
        self._lent_to: PendingDemand | None = None  # the job that called the run's nodes in, while it pends
        self._deferred: list[SlurmNode] = []  # the run's pending node jobs held back meanwhile
        self._lent_until = 0.0
        self._called_in = False  # at most once per run

    @staticmethod
    def _no_host_start(host: Host):
        raise AssertionError("Slurm nodes are submitted, not started on a host")

    # -- the loop ---------------------------------------------------------------------------------------

    def adopt(self, first=()) -> list[str]:
        """The run's node jobs that Slurm still has (a restarted erm launch): taken over, not duplicated.
        ``first``: the run's first node jobs, as (job id, time submitted), which erm launch submitted
        while it loaded ermrun's parser: followed as submitted here (the run's request, no growth)."""
        fresh = RunState(closed=None, demand=None, round=None, node_ids=frozenset())
        for count, (job_id, at) in enumerate(first):
            reason = (
                f"{count} of {self.target(fresh)} node(s) running or pending; {self.demand_reason(fresh)}; "
                "submitted while erm launch loaded ermrun's parser"
            )
            self._submitted(job_id, reason, growth=False, submitted_at=at)
        found = [j for j in self.slurm.jobs() if self._ours(j) and not j.ended and j.job_id not in self.nodes]
        for job in found:
            growth = job.comment == self.options.growth_comment
            node = SlurmNode(job.job_id, job.state, job.nodes, growth=growth)
            self.nodes[job.job_id] = node
            self._emit(
                "adopt", node.host, f"adopted Slurm job {job.job_id} ({job.state} {job.nodes})".strip()
            )
            if job.state == "COMPLETING":  # ending (a previous launcher's scancel): its end is no failure
                node.stop_requested_at, node.stop_reason = (
                    self._clock(),
                    "it was ending when erm launch started",
                )
                node.killed = True
        return [j.job_id for j in found]

    def _ours(self, job: SlurmJob) -> bool:
        return self.options.owns(job.name, job.comment)

    def _waiting_jobs(self, jobs: list[SlurmJob]) -> list[SlurmJob]:
        """Other pending jobs that wait for nodes in any partition that shares a node with the run's: a
        node given back may start them too (clusters often lay several partitions, by time limit or
        priority, over the same nodes). Another run's growth node jobs (niced, yielding themselves) and
        jobs pending for something else than nodes are no demand to give nodes back for."""
        sharing = self._sharing_partitions()
        return [
            j
            for j in jobs
            if j.state == "PENDING"
            and not self._ours(j)
            and sharing & set(j.partitions)
            and not (j.name.startswith("erm-") and j.comment.endswith(GROWTH_MARK))
            and self._waits_for_nodes(j.reason)
        ]

    def _others_waiting(self, jobs: list[SlurmJob]) -> int:
        """Nodes that the waiting jobs ask for (each pending task of an array)."""
        return sum(j.node_count * j.array_tasks for j in self._waiting_jobs(jobs))

    def _partition_map(self) -> dict[str, frozenset[str]] | None:
        """Node -> its partitions, read once from sinfo; None while sinfo fails (said once, read again at
        the next need)."""
        if self._node_partitions is None:
            try:
                self._node_partitions = self.slurm.node_partitions()
            except SlurmError as exc:
                self._warn("sinfo", f"cannot read the partitions' nodes ({exc}); trying again")
        return self._node_partitions

    def _partition_nodes(self) -> set[str] | None:
        """The nodes of the run's partitions; None while unknown."""
        nodes = self._partition_map()
        return None if nodes is None else {n for n, parts in nodes.items() if parts & self.partitions}

    def _sharing_partitions(self) -> set[str]:
        """The run's partitions and every partition that shares a node with them (the run's own while
        sinfo fails)."""
        nodes = self._partition_map() or {}
        ours = [parts for parts in nodes.values() if parts & self.partitions]
        return self.partitions.union(*ours)

    def _waits_for_nodes(self, reason: str) -> bool:
        """Whether a pending job's reason says nodes would start it: an allow-list, so that a reason this
        code does not know is never a reason to give nodes back."""
        first, _, rest = reason.partition(",")
        first = first.strip()
        if first in WAITING_FOR_NODES:
            return True
        if first != REQ_NODE_NOT_AVAIL or "UnavailableNodes:" not in rest:
            return False
        try:
            named = set(expand_hostlist(rest.split("UnavailableNodes:", 1)[1].strip()))
        except HostListError:
            return False
        return bool(named & {n.slurm_node for n in self.nodes.values() if n.slurm_node})

    def tick(self) -> int | None:
        now = self._clock()
        try:
            state = self._read()
        except EtcdError as exc:
            self._warn("etcd", f"cannot read the run from etcd ({exc}); nodes keep running, retrying")
            self._enforce_stop_deadlines(now)  # a stop's bound needs no etcd
            return None
        try:
            jobs = self.slurm.jobs()
        except SlurmError as exc:
            self._warn("squeue", f"{exc}; node jobs keep running, the queue key keeps its last value")
            self._enforce_stop_deadlines(now)
            return None
        by_id = {j.job_id: j for j in jobs}
        self._follow_unknown(jobs)
        ended = self._follow(by_id)
        self._note_registrations(state, ended)  # a node that registered, then ended since, did run
        for node in ended:
            self._on_job_end(node, by_id.get(node.job_id), state)
        if state.closed is None and (why := self._gave_up()) is not None:
            self._say(why)
            self._events.emit("launch", why, action="give_up")
            return 1
        self._enforce_stop_deadlines(now)
        if state.closed is not None:
            if not self._rounds_read:
                self._rounds_read = self._note_round_members()
            return self._closing(state.closed, now)
        for host in self._pool.expired_blacklist():
            self._emit("reinstate", host, f"host {host.name} is off the blacklist; it may run a node again")
        states = self._check_node_health()
        self._stop_suspended()
        self.others_waiting = self._others_waiting(jobs)
        if self.options.call_in:
            self._note_first_round(state, jobs)
            self._lend(jobs, now, states)
        self._write_queue(now)
        self._report_pending(now)
        self._scale(state)
        return None

    def _follow_unknown(self, jobs: list[SlurmJob]) -> None:
        """Jobs of the run that squeue lists and this launcher does not follow: an sbatch that Slurm took
        the job from but that timed out (a busy slurmctld) or printed no job id. Followed from here on
        (counted, stopped as the others; _follow sees them run) instead of unknown to the count, which
        submitted one more node job at every poll that such an sbatch failed."""
        for job in jobs:
            if self._ours(job) and not job.ended and job.job_id not in self.nodes:
                node = SlurmNode(job.job_id, growth=job.comment == self.options.growth_comment)
                self.nodes[job.job_id] = node
                self._emit(
                    "adopt",
                    node.host,
                    f"found Slurm job {job.job_id} of the run ({job.state} {job.nodes}), which its sbatch "
                    "did not report".strip(),
                    job=job.job_id,
                )

    def _follow(self, by_id: dict[str, SlurmJob]) -> list[SlurmNode]:
        """Update each node job from squeue; the ones that ended (or that squeue no longer lists)."""
        ended = []
        for job_id, node in list(self.nodes.items()):
            job = by_id.get(job_id)
            if job is None or job.ended:
                del self.nodes[job_id]
                if job is not None:
                    node.state, node.exit_code = job.state, job.exit_code
                    # a job that ran and ended between two polls: its node is still the one to blame
                    node.slurm_node = node.slurm_node or job.nodes
                ended.append(node)
                continue
            if node.pending and job.state != "PENDING" and job.nodes:
                node.slurm_node = job.nodes
                self._pool.add(Host(name=job.nodes, addr=job.nodes))
                self._pool.take(job.nodes)
                self._emit("running", node.host, f"Slurm job {job_id} runs on {job.nodes}", job=job_id)
            node.state, node.reason = job.state, job.reason
        return ended

    def _on_job_end(self, node: SlurmNode, job: SlurmJob | None, state: RunState) -> None:
        if node.slurm_node:
            self._pool.release(node.slurm_node)
            self._ended_ids.add(node.node_id)
        final = node.state if job is not None else "gone from squeue"
        self.exit_codes[node.node_id] = node.exit_code if node.exit_code is not None else 0
        if node.stopping:
            self._emit(
                "stopped",
                node.host,
                f"node {node.node_id} (Slurm job {node.job_id}) ended: {final}",
                reason=node.stop_reason,
                job=node.job_id,
            )
            return
        if state.closed is not None:
            self._emit(
                "exit", node.host, f"node {node.node_id} exited ({final}; run closed)", job=node.job_id
            )
            return
        error = f"Slurm job {node.job_id} on {node.slurm_node or 'no node'} ended {final}"
        if job is not None and job.reason not in ("", "None"):
            error += f" ({job.reason})"
        self._emit("failure", node.host, f"node {node.node_id} failed: {error}", error=error, job=node.job_id)
        if not node.registered:
            self._start_failures.append(error)
        if job is not None and job.state in NOT_THE_HOST:
            return  # the job's own time limit: a replacement may land on the same host
        if node.slurm_node:
            lost = job is None or job.state in NODE_LOST
            self._blacklist(node.slurm_node, error, at_once=lost)

    def _gave_up(self) -> str | None:
        """Why erm launch gives up: START_FAILURES node jobs in a row ended before their agent registered
        and no node of the run ever did (ermrun cannot start on the nodes: a --workdir or python that the
        compute nodes lack; the jobs' output files say which), rather than submit one more every poll."""
        if self._ever_registered or len(self._start_failures) < START_FAILURES:
            return None
        return (
            f"{len(self._start_failures)} node jobs in a row ended before their ermrun registered, and no "
            f"node of the run ever did; giving up (the node jobs' output, {self.options.output}, says why). "
            "Last failures:\n  " + "\n  ".join(self._start_failures[-3:])
        )

    def _blacklist(self, host_name: str, error: str, at_once: bool) -> None:
        if host_name not in self._pool:
            self._pool.add(Host(name=host_name, addr=host_name))
        cooldown = self._pool.blacklist(host_name, error) if at_once else self._pool.failed(host_name, error)
        if cooldown is not None:
            self._emit(
                "blacklist",
                self._pool.get(host_name).host,
                f"host {host_name} blacklisted for {cooldown:g}s: {error}",
                cooldown_s=cooldown,
            )

    def _check_node_health(self) -> dict[str, str] | None:
        """A node set DOWN or DRAIN under a running node job: stop the job, blacklist the host. Returns
        the node states it read (None: no running node job, or sinfo failed), for this poll's other use."""
        running = [n for n in self.nodes.values() if n.slurm_node and not n.stopping]
        if not running:
            return None
        states = self._node_states()
        if states is None:
            return None
        for node in running:
            st = states.get(node.slurm_node, "")
            if any(bad in st for bad in BAD_NODE_STATES):
                error = f"Slurm node {node.slurm_node} is {st}"
                self._stop(node, f"{error}; a replacement excludes it")
                self._blacklist(node.slurm_node, error, at_once=True)
        return states

    def _node_states(self) -> dict[str, str] | None:
        """sinfo's node states; None while sinfo fails (said once)."""
        try:
            return self.slurm.node_states()
        except SlurmError as exc:
            self._warn("sinfo", f"{exc}; node states unknown")
            return None

    def _stop_suspended(self) -> None:
        """A node job that Slurm suspended (preemption by suspension, gang scheduling, an admin's scontrol
        suspend) holds its node with its agent frozen: the run goes on without it once its lease expires,
        and it would count as live here for as long as Slurm keeps it so. It is cancelled (a frozen ermrun
        cannot leave gracefully), and a replacement takes its place on another node. Not the host's
        fault: no blacklist."""
        for node in self.nodes.values():
            if node.state in SUSPENDED and not node.stopping:
                why = f" ({node.reason})" if node.reason not in ("", "None") else ""
                # a batch signal to a suspended job is not answered (scancel --batch waits out its timeout)
                self._stop(node, f"Slurm {node.state.lower()} its job{why}", cancel=True)
                node.killed = True

    def _write_queue(self, now: float) -> None:
        """The queue key: at once when a count changed (the planner gives nodes back sooner, the first
        round forms with the running nodes), else refreshed every QUEUE_EVERY_S."""
        running = sum(n.state == "RUNNING" and not n.stopping for n in self.nodes.values())
        counts = self.others_waiting, running
        if counts == (self.waiting_nodes, self.running_nodes) and now - self._queue_at < QUEUE_EVERY_S:
            return
        waiting, running = counts
        self._queue_at = now
        rec = QueueRecord(
            waiting_nodes=waiting,
            source="erm launch --slurm: nodes that other pending jobs of "
            f"{','.join(sorted(self._sharing_partitions()))} ask for",
            time=time.time(),
            running_nodes=running,
        )
        try:
            self._client.put(self._keys.queue, rec.to_json())
        except EtcdError as exc:
            self._warn("queue", f"cannot write {self._keys.queue} ({exc})")
            return
        if waiting != self.waiting_nodes:
            self._events.emit(
                "launch",
                f"{waiting} node(s) wanted by other pending jobs",
                action="queue",
                waiting_nodes=waiting,
            )
        self.waiting_nodes, self.running_nodes = waiting, running

    def _report_pending(self, now: float) -> None:
        for node in self.nodes.values():
            if (
                node.pending
                and not node.pending_reported
                and now - node.started_at > self.options.pending_report_s
            ):
                node.pending_reported = True
                self._emit(
                    "pending",
                    node.host,
                    f"Slurm job {node.job_id} pending for more than "
                    f"{self.options.pending_report_s:g}s ({node.reason})",
                    reason=node.reason,
                )

    def _note_first_round(self, state: RunState, jobs: list[SlurmJob]) -> None:
        """Once the run has a round: whether its first round had fewer members than the request (read
        from round 1's record when this launcher saw a later round first), and the run's oldest node job
        id, after which a job arrived later than the run: static's backfill would have started such a job
        before the run when it fit the nodes the run started short on."""
        if self._first_round is not None or state.round is None:
            return
        first = state.round if state.round.round == 1 else self._round_one()
        short = first is not None and len(first.members) < self.request()
        ours = [job_number(j.job_id) for j in jobs if self._ours(j)]
        self._first_round = short, min(ours, default=max((job_number(j.job_id) for j in jobs), default=0))

    def _round_one(self) -> RoundRecord | None:
        """The run's first round's record; None when etcd does not have it or cannot say (the run is then
        not known to have started short, and lends nothing)."""
        key = self._keys.record(1)
        try:
            kv = self._client.get(key)
            return RoundRecord.parse(key, kv.value) if kv is not None else None
        except (EtcdError, RecordError) as exc:
            self._warn("round-one", f"cannot read the run's first round ({exc}); --call-in lends nothing")
            return None

    def _lend(self, jobs: list[SlurmJob], now: float, states: dict[str, str] | None) -> None:
        """--call-in (elastic_rm.launch.slurm_call_in): while the run is short of its request since its
        first round, a job that arrived after the run and would start on the idle nodes plus the
        run's calls them in: as many of the run's running node jobs as it needs stop, the newest first
        (a member's ermrun leaves on SIGTERM without closing the run: the others go on as after a lost
        node, or, when none is left, the next round resumes from the checkpoint), and its pending ones
        are deferred (their start time, which keeps their place in the queue; cancelled where that
        fails). The run then submits nothing until that job no longer pends, or CALL_IN_HOLD_S passed,
        and its deferred node jobs may start again."""
        if self._lent_to is not None:
            pending = {j.job_id for j in jobs if j.state == "PENDING"} & self._lent_to.job_ids
            if pending and now < self._lent_until:
                return
            caller, self._lent_to = self._lent_to, None
            for node in self._deferred:
                if node.pending and not node.stopping:
                    self._set_start(node, "now")
            self._deferred = []
            how = "started" if not pending else f"still pends after {CALL_IN_HOLD_S:g}s"
            message = (
                f"{caller.key}, which called the run's nodes in, {how}: the run asks Slurm for nodes again"
            )
            self._say(message)
            self._events.emit("launch", message, action="call_in_over", caller=caller.key)
            return
        if self._first_round is None or not self._first_round[0] or self._called_in:
            return
        lent = [n for n in self.nodes.values() if n.slurm_node and n.state == "RUNNING" and not n.stopping]
        if not lent or len(lent) >= self.request():  # nothing to lend, or no longer short
            return
        demands = pending_demands(self._waiting_jobs(jobs), jobs)
        if not any(d.first > self._first_round[1] for d in demands):
            return  # nobody arrived later: no sinfo to read
        idle = self._idle_nodes(states)
        if idle is None:
            return
        call = choose_caller(demands, self._first_round[1], idle, len(lent))
        if call is None:
            return
        caller = call.caller
        self._called_in, self._lent_to, self._lent_until = True, caller, now + CALL_IN_HOLD_S
        kept = len(lent) - call.nodes
        message = (
            f"called in by {caller.key}: it arrived after the run, whose first round had fewer nodes "
            f"than its request of {self.request()}, and its {caller.nodes} node(s) start on the "
            f"{idle} idle node(s) and {call.nodes} of the run's {len(lent)}: those stop ("
            + (f"the run goes on with {kept}" if kept else "training resumes later from the checkpoint")
            + f"), its pending node jobs wait in their place, and none is submitted until it no longer "
            f"pends (at most {CALL_IN_HOLD_S:g}s)"
        )
        self._say(message)
        self._events.emit(
            "launch",
            message,
            action="call_in",
            caller=caller.key,
            nodes=caller.nodes,
            idle=idle,
            lent=call.nodes,
            kept=kept,
        )
        for node in sorted(lent, key=lambda n: -n.started_at)[: call.nodes]:  # the newest
            self._stop(node, f"called in by {caller.key}")
        for node in list(self.nodes.values()):
            if node.pending and not node.stopping:
                if self._set_start(node, f"now+{CALL_IN_HOLD_S:.0f}"):
                    self._deferred.append(node)
                else:
                    self._stop(node, f"called in by {caller.key}")

    def _set_start(self, node: SlurmNode, when: str) -> bool:
        """Defer a pending node job (or let it start: ``now``); a failure is said, False."""
        try:
            self.slurm.set_start(node.job_id, when)
        except SlurmError as exc:
            self._say(f"could not set Slurm job {node.job_id}'s start to {when}: {exc}")
            return False
        return True

    def _idle_nodes(self, states: dict[str, str] | None) -> int | None:
        """Idle nodes of the run's partitions, --exclude's left out, from ``states`` (this poll's sinfo,
        read here when the health check did not); None while sinfo cannot say."""
        nodes = self._partition_nodes()
        if nodes is None:
            return None
        states = states if states is not None else self._node_states()
        if states is None:
            return None
        return sum(states.get(n) == "idle" for n in nodes - set(self.options.exclude))

    # -- acting -----------------------------------------------------------------------------------------

    def target(self, state: RunState) -> int:
        """The leader's demand; before its first one, the job description's request (the planner's cold
        start) rather than MAX, so that a run on a shared cluster does not queue MAX node jobs first."""
        if self._before_demand(state):
            return max(self._cfg.min_nodes, min(self.options.requested_nodes, self._cfg.max_nodes))
        return super().target(state)

    def demand_reason(self, state: RunState) -> str:
        if self._before_demand(state):
            wanted = self.options.requested_nodes
            return f"no demand from the leader yet: the job description's request of {wanted}"
        return super().demand_reason(state)

    def _before_demand(self, state: RunState) -> bool:
        d = state.demand
        return bool(self.options.requested_nodes) and (d is None or d.target_nodes <= 0)

    def request(self) -> int:
        """The nodes the run asks for (the job description's request, else --nnodes' minimum): node jobs
        past it are growth, which yields to other jobs."""
        asked = self.options.requested_nodes or self._cfg.min_nodes
        return max(self._cfg.min_nodes, min(asked, self._cfg.max_nodes))

    def _yield_growth(self, live: list[SlurmNode]) -> list[SlurmNode]:
        """While other jobs wait: cancel our pending growth node jobs; the live node jobs left."""
        if self.others_waiting <= 0:
            return live
        for node in live:
            if node.pending and node.growth:
                self._stop(
                    node,
                    f"{self.others_waiting} node(s) wanted by other pending jobs: a node job past the "
                    f"run's request of {self.request()} yields to them",
                )
        return [n for n in live if not n.stopping]

    def _hold(self, holding: bool, target: int) -> None:
        """Report once when growth is held back for other pending jobs, and once when it is no longer held:
        "resume" when no other job waits, "drop" when the demand fell within the request while they wait."""
        if holding == self._holding:
            return
        self._holding = holding
        if holding:
            action = "hold"
            message = (
                f"growth to {target} node(s) held: other pending jobs want {self.others_waiting} node(s) "
                f"and the run has its request of {self.request()}"
            )
        elif self.others_waiting <= 0:
            action, message = "resume", f"growth to {target} node(s) resumes: no other job waits"
        else:
            action = "drop"
            message = (
                f"growth no longer wanted: the demand of {target} node(s) needs no node job past the run's "
                f"request of {self.request()} ({self.others_waiting} node(s) still wanted by other jobs)"
            )
        self._events.emit("launch", message, action=action, target_nodes=target)
        self._say(message)

    def _scale(self, state: RunState) -> None:
        if self._lent_to is not None:
            return  # lent to a job that called the run's nodes in (_lend): nothing to submit or stop
        target = self.target(state)
        self._release_stragglers(state)
        live = self._yield_growth([n for n in self.nodes.values() if not n.stopping])
        # an ended node of ours stays registered until its agent's lease expires: not someone else's node
        self._ended_ids = {i for i in self._ended_ids if among(i, state.node_ids)}  # a rejoin's id too
        ours = [n.node_id for n in self.nodes.values() if n.slurm_node] + sorted(self._ended_ids)
        foreign = self.foreign(state, ours)
        why = self.demand_reason(state)
        held = False
        spares = self._straggler_spares(state)  # node jobs that replace stragglers: not growth
        while len(live) + foreign < target:
            growth = len(live) + foreign >= self.request() + spares
            if growth and self.others_waiting > 0:
                held = True
                break
            reason = f"{len(live) + foreign} of {target} node(s) running or pending; {why}"
            node = self._submit(state, reason, growth)
            if node is None:
                return
            live.append(node)
        self._hold(held, target)
        surplus = len(live) + foreign - target
        if surplus <= 0:
            return
        newest_pending = sorted((n for n in live if n.pending), key=lambda n: n.started_at, reverse=True)
        for node in newest_pending[:surplus]:
            self._stop(node, f"{len(live) + foreign} node job(s), {target} wanted; {why}")
            surplus -= 1
        if surplus <= 0 or state.round is None:
            return
        keep = set(state.round.members) | set(state.round.standby)
        spare = [n for n in live if n.registered and not n.stopping and not among(n.node_id, keep)]
        for node in sorted(spare, key=lambda n: -n.started_at)[:surplus]:
            self._stop(
                node,
                f"{len(live) + foreign} node(s), {target} wanted; round {state.round.round} neither uses nor "
                f"keeps {node.node_id} as standby; {why}",
            )

    @staticmethod
    def _straggler_spares(state: RunState) -> int:
        """Node jobs past the request that replace stragglers: the round's members flagged slow (its
        ``extra.flagged``), when the leader's demand is for spares. Not the demand minus the members: that
        demand may also hold growth, which must yield to other jobs like any growth."""
        rnd, demand = state.round, state.demand
        if rnd is None or demand is None or demand.reason != STRAGGLER_SPARE:
            return 0
        flagged = rnd.extra.get("flagged", [])
        if not isinstance(flagged, list):
            return 0
        return sum(1 for m in rnd.members if m in flagged)

    def _release_stragglers(self, state: RunState) -> None:
        """The nodes the current round replaced or removed as stragglers (its ``stragglers`` field) leave
        whatever the demand: their jobs end and their hosts are blacklisted for the cooldown, so a
        replacement the demand still wants lands on another node."""
        rnd = state.round
        if rnd is None or not rnd.stragglers:
            return
        keep = set(rnd.members) | set(rnd.standby)
        for node in list(self.nodes.values()):
            if node.stopping or not among(node.node_id, rnd.stragglers) or among(node.node_id, keep):
                continue
            self._stop(node, f"round {rnd.round} replaced {node.node_id} as a straggler ({rnd.reason})")
            if node.slurm_node:
                self._blacklist(node.slurm_node, f"a straggler in round {rnd.round}", at_once=True)

    def _exclusions(self, state: RunState) -> list[str]:
        """Hosts a new node job must not land on: blacklisted ones, ours already, and Slurm nodes whose
        node id is still registered in etcd (a previous agent's lease has not expired)."""
        out = {n for n in self._pool.names() if self._pool.blacklisted(n)}
        out |= {n.slurm_node for n in self.nodes.values() if n.slurm_node}
        if self._node_names is None:
            try:
                self._node_names = set(self.slurm.node_states())
            except SlurmError:
                return sorted(out)
        return sorted(out | (set(state.node_ids) & self._node_names))

    def _submit(self, state: RunState, reason: str, growth: bool = False) -> SlurmNode | None:
        excluded = self._exclusions(state)
        if self._all_excluded(excluded):
            return None
        options = self.options.sbatch_options(excluded, growth)
        try:
            job_id = self.slurm.submit(options, self.options.batch_script())
        except SlurmError as exc:
            self._warn(f"sbatch:{exc}", f"{exc}; trying again at the next poll")
            return None
        if growth:
            reason += f"; past the run's request of {self.request()}: --nice={GROWTH_NICE}"
        return self._submitted(job_id, reason, growth=growth)

    def _all_excluded(self, excluded: list[str]) -> bool:
        """Whether no node of the run's partitions may take a node job now (each runs one of the run's
        nodes, is blacklisted, is in --exclude, or its node id is still registered): sbatch would refuse
        the job ("Requested node configuration is not available") at every poll, each refusal a FAILED job
        in Slurm's records. Said once per set of exclusions, with why each node is out."""
        nodes = self._partition_nodes()
        if nodes is None:
            return False  # unknown: sbatch will say
        out = set(excluded) | set(self.options.exclude)
        if not nodes or not nodes <= out:
            self._excluded_said = None
            return False
        key = tuple(sorted(out))
        if key == self._excluded_said:
            return True
        self._excluded_said = key
        ours = nodes & {n.slurm_node for n in self.nodes.values() if n.slurm_node}
        barred = nodes & set(self.options.exclude)
        black = {n for n in nodes - ours - barred if n in self._pool and self._pool.blacklisted(n)}
        why = [
            (ours, "running a node of this run"),
            (black, "blacklisted"),
            (barred, "in --exclude"),
            (nodes - ours - barred - black, "still registered in etcd: a previous agent's lease"),
        ]
        message = (
            f"no node of partition(s) {','.join(sorted(self.partitions))} can take a node job now ("
            + "; ".join(f"{_some(names)}: {what}" for names, what in why if names)
            + "); no node job is submitted until one can"
        )
        self._say(message)
        # the first names only: an event past 16 KiB is refused with ValueError (a partition of 600 nodes,
        # each named twice, ended erm launch)
        self._events.emit(
            "launch",
            message,
            action="excluded",
            excluded=list(key)[:NAMED_AT_MOST],
            excluded_count=len(key),
        )
        return True

    def _submitted(self, job_id: str, reason: str, growth: bool, **data) -> SlurmNode:
        """A node job Slurm took: followed from now on, and said in a `submit` event."""
        self.submitted += 1
        node = SlurmNode(job_id, growth=growth)
        self.nodes[job_id] = node
        self._emit(
            "submit",
            node.host,
            f"submitted Slurm job {job_id}: {reason}",
            reason=reason,
            job=job_id,
            growth=growth,
            **data,
        )
        return node

    def _stop(self, node, reason: str, cancel: bool = False) -> None:
        """SIGTERM to the node job's ermrun (its agent leaves gracefully); a pending job, or with
        ``cancel``, is cancelled instead."""
        if node.stopping:
            return
        node.stop_requested_at = self._clock()
        node.stop_reason = reason
        try:
            if node.pending or cancel:
                self.slurm.cancel(node.job_id)
            else:
                self.slurm.signal(node.job_id, "TERM")
        except SlurmError as exc:
            self._say(f"could not stop Slurm job {node.job_id}: {exc}")
        self._emit(
            "stop",
            node.host,
            f"stopping node {node.node_id} (Slurm job {node.job_id}): {reason}",
            reason=reason,
            job=node.job_id,
        )

    def _enforce_stop_deadlines(self, now: float) -> None:
        for node in self.nodes.values():
            asked = node.stop_requested_at
            if asked is not None and not node.killed and now - asked > self._cfg.stop_grace_s:
                node.killed = True
                self._say(f"node {node.node_id} did not stop within {self._cfg.stop_grace_s:g}s; scancel")
                self._cancel([node.job_id])

    def _cancel(self, job_ids: list[str]) -> None:
        try:
            self.slurm.cancel(*job_ids)
        except SlurmError as exc:
            self._say(f"scancel failed: {exc}")

    def stop_all(self, reason: str) -> list[str]:
        """Every node job of the run: SIGTERM to ermrun (pending ones cancelled), then scancel after the stop
        grace, or at once when a signal hurries the stop (interrupts.py). The run's jobs that squeue
        lists and this launcher does not follow (an sbatch interrupted after Slurm took its job) are
        stopped too. Returns once squeue lists none of them, else (bounded, or on one more signal, after
        the hurried scancel) what scancel needs to end those left, named for the user: their job ids, or
        ``--name=erm-<run>`` when squeue never answered. A later call returns the same."""
        if self._left is not None:
            return self._left
        self._interrupts.stop()
        for node in list(self.nodes.values()):
            if self._interrupts.hurry:
                break  # the hurried scancel below stops them all
            self._stop(node, reason)
        cancel_at = self._clock() + self._cfg.stop_grace_s
        deadline, cancelled, hurried, listed = cancel_at + self.slurm.cancel_wait_s(), False, False, False
        while self._clock() <= deadline:
            if self._interrupts.hurry and not hurried:
                hurried, cancel_at = True, self._clock()
                deadline = cancel_at + self.slurm.cancel_wait_s()
            if not cancelled and self._clock() >= cancel_at and self.nodes:
                cancelled = True
                self._say(f"cancelling Slurm job(s) {' '.join(self.nodes)} (scancel)")
                self._cancel(list(self.nodes))
            try:
                jobs = self.slurm.jobs()
            except SlurmError as exc:  # none is known to have ended: scancel them again until the bound
                self._warn("squeue", f"{exc}; scancel is tried until the stop grace is over")
                with contextlib.suppress(SlurmError):
                    self.slurm.cancel(*self.nodes)
                if self._interrupts.leave:
                    break
                time.sleep(0.2)
                continue
            listed = True
            for job in jobs:
                if self._ours(job) and not job.ended and job.job_id not in self.nodes:
                    self._stop_unknown(job, reason, cancel=cancelled)
            by_id = {j.job_id: j for j in jobs}
            for job_id, node in list(self.nodes.items()):
                job = by_id.get(job_id)
                if job is None or job.ended:
                    del self.nodes[job_id]
                    self._emit(
                        "stopped", node.host, f"node {node.node_id} (Slurm job {job_id}) ended", job=job_id
                    )
            if not self.nodes or self._interrupts.leave:
                break
            time.sleep(0.2)
        self._left = list(self.nodes)
        if not listed:  # a job of the run this launcher does not know of may run too
            name = self.options.job_name
            self._say(
                f"squeue never answered during the stop: scancel --name={name} cancels every job of the run"
            )
            self._left = self._left or [f"--name={name}"]
        if self.nodes:
            ids = " ".join(self.nodes)
            self._say(f"Slurm may still run job(s) {ids}: scancel {ids}")
        self.nodes.clear()
        return self._left

    def _stop_unknown(self, job: SlurmJob, reason: str, cancel: bool) -> None:
        """A job of the run whose sbatch never returned its id: followed and stopped with the others."""
        node = SlurmNode(job.job_id, job.state, job.nodes, growth=job.comment == self.options.growth_comment)
        self.nodes[job.job_id] = node
        self._emit("adopt", node.host, f"found Slurm job {job.job_id} of the run ({job.state} {job.nodes})")
        self._stop(node, reason)
        if cancel:
            self._cancel([job.job_id])

    def _note_round_members(self) -> bool:
        """A node job whose node was ever a member or standby of one of the run's rounds joined it, even if
        its agent registered and left between two polls (a short run's last one): it gets --exit-grace to
        finish. Read from the round records once the run closed; False when etcd could not say."""
        try:
            kvs, _ = self._client.get_prefix(self._keys.rounds)
        except EtcdError as exc:
            self._warn("rounds", f"cannot read the run's rounds ({exc}); joined nodes judged from polls")
            return False
        joined: set[str] = set()
        for kv in kvs:
            if not kv.key.endswith("/record"):
                continue
            try:
                rnd = RoundRecord.parse(kv.key, kv.value)
            except RecordError:
                continue  # the leader reports a malformed record; it names no node here
            joined.update(rnd.members, rnd.standby)
        for node in self.nodes.values():
            if node.slurm_node and among(node.node_id, joined):
                node.registered = True
        return True

    def _closing(self, closed: ClosedRecord, now: float) -> int | None:
        """Node jobs that never joined the run (still pending, or still starting) have nothing to finish:
        they stop at once, and the launcher does not wait out --exit-grace for them."""
        for node in list(self.nodes.values()):
            if not node.registered and not node.stopping:
                self._stop(node, f"the run was closed by {closed.by}; this node job never joined it")
        return super()._closing(closed, now)

    def _check_idle(self, now: float) -> int | None:
        return None
