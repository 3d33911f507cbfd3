"""The leader: one node per run turns the policy's decisions into rounds.

Every node runs this loop. A node that finds no leader campaigns (creates the ``leader`` key with its
node lease); the winner follows nodes and acks, asks the :class:`RoundPolicy` what to do on every
change (and when the policy asks to be woken), writes new rounds and seals a round once all of its
members acked it. Every write carries the election's fence and the round key's mod revision, so a
deposed leader, or two leaders in a race, can never both write: the second transaction fails.

The first round: while no round exists, the policy is asked only once MIN nodes registered and, when the
run's ``queue`` record says its pool runs more node jobs than have registered (``running_nodes``, written
by `erm launch --slurm`), once those registered too or FIRST_ROUND_WAIT_S passed (both said in events).
Their agents are still starting; a first round formed without them is followed at once by a scale-up
round. A missing or stale record counts 0 and never holds a round (queue_signal.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from ..background import Background
from ..etcd.client import Compare, EtcdClient, Op
from ..etcd.errors import EtcdError
from ..etcd.lease import Election
from ..obs.events import EventLog, ids_for_event
from ..planner.interface import ClusterSnapshot, Decision, RoundPolicy
from ..wire.records import STRAGGLERS, DemandRecord, LedgerRecord, RoundRecord
from .cluster_snapshot import cluster_snapshot
from .outcome import BEFORE, PendingOutcome
from .queue_signal import QueueSignal
from .seal import sealed_at_once
from .view import JobView

log = logging.getLogger(__name__)

IDLE_WAKEUP_S = 1.0  # re-evaluate at least this often, even with no change
# after a policy run of t seconds, the next one waits t (the leader decides <= half the time)
DECIDE_PACE = 1.0
DECIDE_PAUSE_MAX_S = 0.25  # but never longer than this
# A node outside the current round's members campaigns only after the run had no leader this long: a
# member (alive, not flagged slow, not scaled away) takes the leadership first (see _campaign_after).
LEADERLESS_GRACE_S = 1.0
# The first round waits at most this long for node jobs that run but whose agents have not registered yet
FIRST_ROUND_WAIT_S = 30.0
FIRST_ROUND_RECHECK_S = 0.5  # how often a held first round looks at the queue record again


class RoundLeader:
    def __init__(
        self,
        client: EtcdClient,
        view: JobView,
        node_id: Callable[[], str],
        lease_id: Callable[[], int | None],
        policy: RoundPolicy,
        min_nodes: int,
        max_nodes: int,
        last_call_timeout: float,
        job: dict | None = None,
        events: EventLog | None = None,
    ):
        self._client = client
        self._view = view
        self._node_id = node_id
        self._lease_id = lease_id
        self._policy = policy
        self._min, self._max = min_nodes, max_nodes
        self._last_call = last_call_timeout
        self._job = job or {}
        self._events = events
        self._demand: tuple[int, str] | None = None  # last written (target_nodes, reason)
        self._outcome: PendingOutcome | None = None  # the round written last, until its outcome is measured
        self._leaderless_since: float | None = None  # monotonic time the run was first seen without a leader
        self._handed_over = 0  # the election revision this node gave up (the watch may still show it)
        self._left_out_of = 0  # the round it handed the leadership over for
        self._outcome_seen = 0  # the newest round whose outcome this leader took up (or wrote)
        self._election: Election | None = None
        self._announced = True  # False from a won election until its set-up (tracking, history) is done
        self._decided_at_version = -1  # membership_version of the view when the policy last ran
        self._metrics_seen = -1  # metrics_version of the view when the policy last ran
        self._history: tuple[dict, ...] = ()
        self._wake_at = 0.0
        self._next_decide_at = 0.0  # the policy runs again no sooner than this (monotonic)
        self._queue = QueueSignal(client, view.keys)  # the cluster's queue, when an executor writes it
        self._first_wait_since: float | None = None  # monotonic time this leader began to hold round 1
        self._first_wait_said = ""  # the last hold event emitted ("wait" or "done")
        self._loop = Background(self._run, "erm-leader", wake=self._wake)
        self.last_reason = ""

    def start(self) -> None:
        self._loop.start()

    def stop(self) -> None:
        self._loop.stop(timeout_s=5)

    def _wake(self) -> None:
        """The loop waits on the view's condition: wake it to see the stop."""
        self._view.wake_waiters()

    @property
    def leading(self) -> bool:
        view = self._view
        return self._election is not None and view.leader_rev == self._election.revision

    def _run(self, stopping: threading.Event) -> None:
        seen, wake_at = -1, 0.0
        while not stopping.is_set():
            timeout = max(0.0, min(IDLE_WAKEUP_S, wake_at - time.monotonic())) if wake_at else IDLE_WAKEUP_S
            seen = self._view.wait(seen, timeout)
            if stopping.is_set():
                return
            try:
                wake_at = self._step()
            except EtcdError as exc:
                log.warning("leader step failed (%s); retrying", exc)
                stopping.wait(0.2)
            except Exception:  # noqa: BLE001 - keep leading through a policy bug, loudly
                log.exception("round policy failed; retrying in 1 s")
                stopping.wait(1.0)

    def _step(self) -> float:
        view = self._view
        if view.closed is not None or view.error is not None:
            return 0.0
        if not self.leading:
            lease = self._lease_id()
            if lease is None:
                return 0.0
            if (wait_until := self._campaign_after()) is not None:
                return wait_until
            election = Election(self._client, view.keys.leader, self._node_id(), lease)
            if view.leader == self._node_id() and view.leader_rev not in (0, self._handed_over):
                election.revision = view.leader_rev  # our campaign won though its answer was lost
            elif view.leader is not None or not election.try_acquire():
                return 0.0
            self._election, self._announced = election, False
            self._leaderless_since = None  # the run has a leader: a later leaderless time starts afresh
        if not self._announced:  # retried here when etcd failed part way (a partition, a timeout)
            election = self._election
            assert election is not None
            view.track_members()
            self._history = self._read_history()
            adopt_straggler_flags(self._policy, view.round, self._node_id())
            self._outcome_seen = 0  # the current round's outcome is this leader's to measure, if unrecorded
            self._announced = True
            view.note_leadership(self._node_id(), election.revision or 0)  # ahead of the watch
            log.info("node %s leads run %s", self._node_id(), view.keys.run_id)
            self._emit("leader", f"{self._node_id()} leads run {view.keys.run_id}")
            self._demand = None  # a new leader states the demand afresh
        self._seal_if_acked()
        self._measure_outcome()
        # The policy runs when membership changed or when it asked to be woken; an ack alone does not
        # change what it would decide (and running it per ack would cost O(N^2) at large N).
        due = self._wake_at and time.monotonic() >= self._wake_at
        new_metrics = view.metrics_version != self._metrics_seen and self._job.get("tables")
        if view.membership_version == self._decided_at_version and not due and not new_metrics:
            return self._wake_at
        if view.round is None and len(view.nodes) < self._min:
            self._decided_at_version = view.membership_version
            return 0.0  # no policy may form a round below MIN: skip the O(N) snapshot per arrival
        if view.round is None and (look_again := self._first_round_wait()) is not None:
            self._decided_at_version, self._wake_at = view.membership_version, look_again
            return look_again
        now = time.monotonic()
        full = view.round is None and len(view.nodes) >= self._max  # the first round cannot grow: decide now
        if now < self._next_decide_at and not full:
            return self._next_decide_at  # changes that come meanwhile are decided on together
        self._decided_at_version = view.membership_version
        self._metrics_seen = view.metrics_version
        plan = self._policy.decide(self._snapshot())
        # The next decision waits as long as this one took (snapshot and policy are O(N)): a burst of
        # arrivals at 1,000 nodes is decided in a few batches instead of once per node, O(N^2).
        self._next_decide_at = time.monotonic() + min(
            DECIDE_PACE * (time.monotonic() - now), DECIDE_PAUSE_MAX_S
        )
        self._publish_demand()
        if isinstance(plan, Decision):
            self._write_round(plan)
            self._wake_at = 0.0
            return 0.0
        if plan.reason != self.last_reason:
            log.debug("leader waits: %s", plan.reason)
            self.last_reason = plan.reason
        self._wake_at = plan.until or 0.0
        return self._wake_at

    def _first_round_wait(self) -> float | None:
        """None: the first round may be decided now. Else when to look again: the pool runs more of the
        run's node jobs than have registered, and FIRST_ROUND_WAIT_S has not passed since the hold began."""
        registered = len(self._view.nodes)
        running = min(self._queue.running_nodes(), self._max)
        now = time.monotonic()
        if registered >= running:
            if self._first_wait_said == "wait":
                self._say_first_wait("done", f"round 1: all {running} running node job(s) registered")
            return None
        since = self._first_wait_since = self._first_wait_since or now
        if now - since >= FIRST_ROUND_WAIT_S:
            self._say_first_wait(
                "done",
                f"round 1: {registered} of {running} running node job(s) registered after "
                f"{FIRST_ROUND_WAIT_S:g}s; deciding without the others",
            )
            return None
        self._say_first_wait(
            "wait",
            f"round 1 waits for {running - registered} more node(s) that the pool runs, whose agents are "
            f"still starting (at most {FIRST_ROUND_WAIT_S:g}s)",
        )
        return min(now + FIRST_ROUND_RECHECK_S, since + FIRST_ROUND_WAIT_S)

    def _say_first_wait(self, what: str, message: str) -> None:
        if self._first_wait_said == what:
            return
        self._first_wait_said = what
        log.info(message)
        self._emit("leader", message, action=f"first_round_{what}")

    def _emit(self, kind: str, message: str, **data) -> None:
        if self._events is not None:
            self._events.emit(kind, message, **data)

    def _publish_demand(self) -> None:
        """Write ``demand`` when the policy's wanted node count changed (a policy without one: never)."""
        demand = self._policy.wanted_nodes()
        if demand is None or demand[0] <= 0 or (self._demand and demand[0] == self._demand[0]):
            return  # only a new count is news; the reason's wording changes with every sample
        target, reason = demand
        r = self._view.round
        record = DemandRecord(target, reason, self._node_id(), r.round if r else 0, time.time())
        assert self._election is not None
        result = self._client.txn(
            [self._election.fence()], [Op.put(self._view.keys.demand, record.to_json())]
        )
        if result.succeeded:
            self._demand = demand
            log.info("demand: %d node(s) (%s)", target, reason)
            self._emit("demand", f"wants {target} node(s): {reason}", target_nodes=target, reason=reason)

    def publish_ledger(self, record: LedgerRecord) -> bool:
        """Write ``ledger``, fenced by the election (a deposed leader's write fails). False when this node
        does not lead or lost the fence; any thread may call it."""
        election = self._election
        if not self.leading or election is None:
            return False
        result = self._client.txn([election.fence()], [Op.put(self._view.keys.ledger, record.to_json())])
        return result.succeeded

    def _job_throughput(self, members) -> float | None:
        """Samples/s of the job over the agents' last step window, or None until every member has steps."""
        with self._view.cond:
            metrics = [self._view.metrics.get(m) for m in members]
        if not members or any(m is None or m.steps is None for m in metrics):
            return None
        return sum(m.steps.samples_per_s for m in metrics)  # type: ignore[union-attr]

    def _measure_outcome(self) -> None:
        """Once a written round has run a full step window, record what it did against what was predicted:
        ``rounds/<n>/outcome`` and an "outcome" event (the planner's model meets the measurement)."""
        o, r = self._outcome, self._view.round
        if o is None and r is not None and r.round > self._outcome_seen:  # a round another leader wrote
            self._outcome_seen = r.round  # (it may reach the view after this node's election)
            o = self._outcome = self._unmeasured(r)
        if o is None:
            return
        if r is None or r.round != o.round:
            self._outcome = None  # superseded before it could be measured
            return
        throughput = self._job_throughput(r.members) if r.sealed else None
        outcome = o.measured(r, throughput, list(self._policy.model_coef()))
        if outcome is None:
            return
        assert self._election is not None
        self._client.txn(
            [self._election.fence()], [Op.put(self._view.keys.outcome(r.round), json.dumps(outcome))]
        )
        self._outcome = None
        fmt = lambda g: "-" if g is None else f"{g:+.0%}"  # noqa: E731
        measured, predicted, error = (
            outcome[k] for k in ("measured_gain", "predicted_gain", "prediction_error")
        )
        self._emit(
            "outcome",
            f"round {r.round}: {throughput:,.0f} samples/s, measured {fmt(measured)}, "
            f"predicted {fmt(predicted)}, error {fmt(error)}",
            **{k: v for k, v in outcome.items() if k != "v"},
        )

    def _unmeasured(self, r: RoundRecord | None) -> PendingOutcome | None:
        """A new leader's round to measure: the current one, unless its outcome is recorded already."""
        pending = PendingOutcome.of(r)
        if pending is None or self._client.get(self._view.keys.outcome(pending.round)) is not None:
            return None
        return pending

    def _campaign_after(self) -> float | None:
        """None: campaign now. Else when to look again: a node that is not a member of the current round
        (a standby, a straggler swapped out, a node scaled away) leaves the leadership to the members,
        and campaigns only once the run had no leader for LEADERLESS_GRACE_S (every member gone)."""
        view = self._view
        if view.leader is not None:
            self._leaderless_since = None
            return None  # nothing to campaign for; _step returns
        now = time.monotonic()
        since = self._leaderless_since = self._leaderless_since or now
        r = view.round
        # the round this node handed over for may reach the view after the leader key's deletion
        outside = self._left_out_of > (r.round if r else 0) or bool(
            r and r.members and self._node_id() not in r.members
        )
        return since + LEADERLESS_GRACE_S if outside and now - since < LEADERLESS_GRACE_S else None

    def _hand_over(self, record: RoundRecord) -> None:
        """This leader wrote a round that leaves it out: give the leadership to a member (which seals
        the round and measures its outcome). A standby's process may be the slow one: in a straggler
        swap the leader was often the throttled node, and sealing there cost the round a tenth of a second."""
        election = self._election
        assert election is not None
        self._client.txn([election.fence()], [Op.delete(self._view.keys.leader)])
        self._election, self._outcome, self._handed_over = None, None, election.revision or 0
        self._left_out_of = record.round
        log.info("node %s is not in round %d: a member leads", self._node_id(), record.round)
        self._emit("leader", f"{self._node_id()} is not in round {record.round}; a member leads from now on")

    def _read_history(self) -> tuple[dict, ...]:
        """Finished runs of this job's signature (stage 1 of the planner), as JSON objects."""
        if not self._job.get("tables"):
            return ()
        from ..planner.history import HistoryError, parse_record
        from ..planner.job import parse_job

        signature = parse_job(self._job).signature()
        kvs, _ = self._client.get_prefix(f"{self._view.keys.prefix}/history/{signature}/")
        records = []
        for kv in kvs:
            try:
                data = json.loads(kv.value)
            except (ValueError, RecursionError):  # not UTF-8 or not JSON, huge numbers, absurd nesting
                log.error("malformed value in etcd key %s: not JSON; ignored for the warm start", kv.key)
                continue
            try:  # the policy skips such a record too, without a word: it does no I/O
                parse_record(data, f"etcd key {kv.key}")
            except HistoryError as e:
                log.error("malformed value in %s; ignored for the warm start", e)
                continue
            records.append(data)
        return tuple(records)

    def _snapshot(self) -> ClusterSnapshot:
        waiting = self._queue.waiting_nodes() if self._job.get("tables") else None
        return cluster_snapshot(
            self._view, self._min, self._max, self._last_call, self._job, self._history, waiting
        )

    def _fenced_write(self, record: RoundRecord) -> bool:
        view = self._view
        assert self._election is not None
        result = self._client.txn(
            [self._election.fence(), Compare.mod(view.keys.round, view.round_rev)],
            [
                Op.put(view.keys.round, record.to_json()),
                Op.put(view.keys.record(record.round), record.to_json()),
            ],
        )
        if result.succeeded:
            view.set_round(record, result.revision)
        else:
            log.debug("round %d write lost a race (deposed or stale view); re-reading", record.round)
        return result.succeeded

    def _write_round(self, decision: Decision) -> None:
        current = self._view.round
        kept = set(decision.members)
        before = self._job_throughput(current.members) if current else None
        with self._view.cond:  # old members left out but alive: they can still drain at a step boundary
            alive = [
                m for m in (current.members if current else ()) if m in self._view.nodes and m not in kept
            ]
        flagged = sorted(self._policy.flagged)  # carried by the round to the next leader
        # the old members this round leaves out as stragglers: an executor releases them first and keeps
        # their hosts out of its next nodes (the reason says it in words)
        dropped = [m for m in (current.members if current else ()) if m in flagged and m not in kept]
        record = RoundRecord(
            round=(current.round if current else 0) + 1,
            members=tuple(decision.members),
            standby=tuple(decision.standby),
            reason=decision.reason,
            leader=self._node_id(),
            predicted_gain=decision.predicted_gain,
            confidence=decision.confidence,
            time=time.time(),
            extra={"alive": alive, "flagged": flagged, STRAGGLERS: dropped, BEFORE: before},
        )
        record = self._sealed_at_once(record)
        if self._fenced_write(record):
            log.info(
                "round %d%s: %d member(s) %s; %s",
                record.round,
                " (sealed: all members waiting)" if record.sealed else "",
                len(record.members),
                list(record.members),
                record.reason,
            )
            self._emit(
                "decision",
                f"round {record.round}: {len(record.members)} member(s); {record.reason}",
                round=record.round,
                **ids_for_event(members=record.members, standby=record.standby),
                reason=record.reason,
                predicted_gain=record.predicted_gain,
                confidence=record.confidence,
                sealed=record.sealed,
            )
            if record.sealed:
                self._drop_old_store(record.round)
            self._outcome, self._outcome_seen = PendingOutcome(record.round, before), record.round
            if record.members and self._node_id() not in record.members:
                self._hand_over(record)

    def _sealed_at_once(self, record: RoundRecord) -> RoundRecord:
        """The round written sealed when no member needs to ack it (seal.py says when)."""
        with self._view.cond:
            entries = [self._view.nodes.get(m) for m in record.members]
            return sealed_at_once(record, [e.record if e else None for e in entries], self._view.round)

    def _seal_if_acked(self) -> None:
        view = self._view
        with view.cond:
            r = view.round
            if r is None or r.sealed or not r.members:
                return
            acks = dict(view.acks.get(r.round, {}))
        if not set(r.members) <= set(acks):
            return
        rank0 = acks[r.members[0]]
        if self._fenced_write(replace(r, sealed=True, master=rank0.master)):
            log.info("round %d complete: world of %d node(s)", r.round, len(r.members))
            self._emit(
                "round",
                f"round {r.round} complete: world of {len(r.members)} node(s)",
                round=r.round,
                **ids_for_event(members=r.members, standby=r.standby),
                reason=r.reason,
            )
            self._drop_old_store(r.round)

    def _drop_old_store(self, sealed: int) -> None:
        """The agents' stores of rounds before the previous one are done with once ``sealed`` is."""
        if sealed > 2:
            self._client.delete(self._view.keys.store(sealed - 2), prefix=True)


def adopt_straggler_flags(policy: RoundPolicy, current: RoundRecord | None, node_id: str) -> None:
    """Seed ``policy`` with the straggler flags of ``current`` (``extra.flagged``; a malformed value is
    logged and ignored).

    Why: the planner's state lives in the leader's memory, and a new leader starts afresh. It re-profiles
    safely, but a straggler it no longer knew about would be taken back: a successor elected right after a
    straggler swap would fill the survivors' round with the replaced node, still slow, over another
    standby. So each round record carries the flags, and a leader that takes over adopts those of the
    current round."""
    if current is None or "flagged" not in current.extra:
        return
    flagged = current.extra["flagged"]
    if not isinstance(flagged, list) or not all(isinstance(n, str) for n in flagged):
        log.warning("round %d: extra.flagged is %r, not a list of node ids; ignored", current.round, flagged)
        return
    if flagged:
        log.info("node %s: straggler flags of round %d taken over: %s", node_id, current.round, flagged)
    policy.adopt_flagged(frozenset(flagged))
