"""The executor: keeps as many nodes running as the leader's policy wants, on the hosts it is given.

Every ``poll`` seconds it reads the run from etcd (``demand``, ``round``, ``nodes/``, ``closed``) and acts:

- fewer nodes running than wanted: start nodes on free hosts (``demand`` when the leader wrote one, else
  ``--nnodes`` MAX: the plain membership policy takes every node up to MAX);
- more nodes running than wanted: release nodes that the current round neither uses nor keeps as standby
  (the planner lists the standby it wants; "the rest are free to release"). A member is never stopped to
  meet the demand: the planner first writes a round without it;
- a host removed from the discovery output: its node is stopped, member or not (the rendezvous then forms
  a round of the others);
- a node that exits while the run is open failed: its host's failure count grows, and a host that fails
  repeatedly is blacklisted for a cooldown (elastic_rm.launch.pool);
- the run is closed (the job finished or failed): nodes get ``exit_grace`` seconds to exit, then are
  stopped; the exit status is that of the node that closed the run;
- Ctrl-C or SIGTERM: every node is stopped (:meth:`Executor.stop_all`); a second signal kills them at
  once, a third returns without waiting (elastic_rm.launch.interrupts).

Every action is an event of kind ``launch`` in the run's event log.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..obs.events import EventLog
from ..wire.keyspace import Keyspace
from ..wire.records import ClosedRecord, DemandRecord, RecordError, RoundRecord
from .discovery import DiscoveryError, diff_hosts
from .hostfile import Host, HostfileError
from .interrupts import Interrupts
from .node import RemoteNode
from .pool import HostPool
from .ssh import SSH_EXIT_ERROR

log = logging.getLogger(__name__)

# how long a hurried stop (a second signal: every host's ermrun killed) waits for the nodes' ssh clients to
# end before it kills them here and names their hosts
KILL_WAIT_S = 10.0


@dataclass(frozen=True)
class ExecutorConfig:
    min_nodes: int
    max_nodes: int
    poll_s: float = 1.0
    stop_grace_s: float = 30.0  # a stopped node's host supervisor kills ermrun after this; we wait 10 s more
    exit_grace_s: float = 60.0  # after the run closed, how long nodes get to exit by themselves
    idle_timeout_s: float = 300.0  # no node running and no host to start one on: give up after this
    discovery_interval_s: float = 10.0


@dataclass(frozen=True)
class RunState:
    """What the executor reads from etcd on each poll."""

    closed: ClosedRecord | None
    demand: DemandRecord | None
    round: RoundRecord | None
    node_ids: frozenset[str]


def same_node(node_id: str, seen: str) -> bool:
    """A rendezvous node id of ours: ours, or a re-incarnation of it after a lost lease (``<id>-r<n>``)."""
    return seen == node_id or (seen.startswith(node_id + "-r") and seen[len(node_id) + 2 :].isdigit())


def among(node_id: str, ids) -> bool:
    """Whether ``node_id`` (or a re-incarnation of it) is one of ``ids``."""
    return any(same_node(node_id, i) for i in ids)


class Executor:
    def __init__(
        self,
        client: EtcdClient,
        keys: Keyspace,
        pool: HostPool,
        start_node: Callable[[Host], RemoteNode],
        events: EventLog,
        config: ExecutorConfig,
        say: Callable[[str], None],
        discover: Callable[[], list[Host]] | None = None,
        known_hosts: list[Host] | None = None,
        interrupts: Interrupts | None = None,
    ):
        self._client, self._keys, self._pool = client, keys, pool
        self._start_node, self._events, self._cfg, self._say = start_node, events, config, say
        self._discover = discover
        self._known: list[Host] = list(known_hosts or [])  # the last discovery answer
        self._next_discovery = time.monotonic() + config.discovery_interval_s
        self.nodes: dict[str, RemoteNode] = {}  # by host name
        self.exit_codes: dict[str, int] = {}  # by node id, the last exit of each
        self._closing_deadline: float | None = None
        self._idle_since: float | None = None
        self._ever_registered = False
        self._warned: set[str] = set()
        self._discovery_failing = False  # the last discovery (or hostfile re-read) failed: warned already
        self._interrupts = interrupts or Interrupts()  # erm launch's signals: a second one hurries stop_all
        self._left: list[str] | None = None  # what stop_all left, once it ran

    # -- the loop ---------------------------------------------------------------------------------------

    def run(self) -> int:
        """Until the run closes; returns the exit status. Stops every node it started before returning
        (also on KeyboardInterrupt, which it lets through)."""
        try:
            while True:
                rc = self.tick()
                if rc is not None:
                    return rc
                time.sleep(self._cfg.poll_s)
        finally:
            self.stop_all("erm launch is exiting")

    def tick(self) -> int | None:
        """One round of observe-and-act; an exit status once the job is over."""
        now = time.monotonic()
        if self._discover is not None and now >= self._next_discovery:
            self._refresh_hosts()
            self._next_discovery = now + self._cfg.discovery_interval_s
        exited = [
            (name, node, rc) for name, node in list(self.nodes.items()) if (rc := node.poll()) is not None
        ]
        try:
            state = self._read()
        except EtcdError as exc:
            self._warn("etcd", f"cannot read the run from etcd ({exc}); nodes keep running, retrying")
            self._enforce_stop_deadlines(now)  # a stop's bound needs no etcd
            return None
        for name, node, rc in exited:
            self._on_exit(name, node, rc, state)
        self._note_registrations(state)
        self._enforce_stop_deadlines(now)
        if state.closed is not None:
            return self._closing(state.closed, now)
        for host in self._pool.expired_blacklist():
            self._emit("reinstate", host, f"host {host.name} is off the blacklist; it may run a node again")
        self._scale(state)
        return self._check_idle(now)

    # -- reading ----------------------------------------------------------------------------------------

    def _read(self) -> RunState:
        keys = self._keys

        def parsed(key: str, kind):
            kv = self._client.get(key)
            if kv is None:
                return None
            try:
                return kind.parse(key, kv.value)
            except RecordError as exc:
                self._warn(key, f"{exc} (ignored by erm launch)")
                return None

        nodes, _ = self._client.get_prefix(keys.nodes)
        return RunState(
            closed=parsed(keys.closed, ClosedRecord),
            demand=parsed(keys.demand, DemandRecord),
            round=parsed(keys.round, RoundRecord),
            node_ids=frozenset(keys.node_of(kv.key) for kv in nodes),
        )

    # -- acting -----------------------------------------------------------------------------------------

    def target(self, state: RunState) -> int:
        """How many nodes should run: the leader's demand, else MAX; always within --nnodes MIN..MAX."""
        d = state.demand
        want = d.target_nodes if d is not None and d.target_nodes > 0 else self._cfg.max_nodes
        return max(self._cfg.min_nodes, min(want, self._cfg.max_nodes))

    def demand_reason(self, state: RunState) -> str:
        """Why the target is what it is, for the reason of a start or a stop."""
        d = state.demand
        if d is not None and d.target_nodes > 0:
            return f"demand {d.target_nodes} ({d.reason})"
        return f"no demand from the leader: up to --nnodes MAX {self._cfg.max_nodes}"

    @staticmethod
    def foreign(state: RunState, ours: list[str]) -> int:
        """Registered nodes that this launcher did not start (given its own node ids ``ours``)."""
        return sum(1 for i in state.node_ids if not any(same_node(o, i) for o in ours))

    def _scale(self, state: RunState) -> None:
        target = self.target(state)
        running = [n for n in self.nodes.values() if not n.stopping]
        # Nodes registered that we did not start (another erm launch, ermrun by hand) count as running:
        # several launchers of one run then add up to the demand instead of each filling it.
        foreign = self.foreign(state, [n.node_id for n in self.nodes.values()])
        why = self.demand_reason(state)
        if len(running) + foreign < target:
            for host in self._pool.free():
                if len(running) + foreign >= target:
                    break
                if among(host.node_id, state.node_ids):
                    self._warn(
                        f"stale-{host.name}",
                        f"node {host.node_id} is still registered in etcd (its "
                        "last agent's lease has not expired); starting it once the key is gone",
                    )
                    continue
                count = len(running) + foreign
                running.append(self._start(host, f"{count} of {target} node(s) running; {why}"))
        elif len(running) + foreign > target and state.round is not None:
            keep = set(state.round.members) | set(state.round.standby)
            spare = [n for n in running if n.registered and not among(n.node_id, keep)]
            surplus = len(running) + foreign - target
            for node in sorted(spare, key=lambda n: n.started_at, reverse=True)[:surplus]:
                self._stop(
                    node,
                    f"{len(running) + foreign} node(s) running, {target} wanted; round {state.round.round} "
                    f"neither uses nor keeps {node.node_id} as standby; {why}",
                )

    def _start(self, host: Host, reason: str) -> RemoteNode:
        self._pool.take(host.name)
        node = self._start_node(host)
        self.nodes[host.name] = node
        self._emit("start", host, f"started node {host.node_id} on {host.where()}: {reason}", reason=reason)
        return node

    def _stop(self, node: RemoteNode, reason: str) -> None:
        if node.stopping:
            return
        node.request_stop(reason)
        self._emit(
            "stop", node.host, f"stopping node {node.node_id} on {node.host.where()}: {reason}", reason=reason
        )

    def _on_exit(self, name: str, node: RemoteNode, rc: int, state: RunState) -> None:
        del self.nodes[name]
        self._pool.release(name)
        self.exit_codes[node.node_id] = rc
        host = node.host
        if node.stopping:
            back = "host back in the free pool" if name in self._pool else "host no longer listed"
            self._emit(
                "stopped",
                host,
                f"node {node.node_id} stopped (exit {rc}); {back}",
                rc=rc,
                reason=node.stop_reason,
            )
        elif state.closed is not None:
            self._emit("exit", host, f"node {node.node_id} exited with {rc} (run closed)", rc=rc)
        else:
            if rc == SSH_EXIT_ERROR:
                error = f"ssh to {host.where()} failed (exit {rc}): {node.tail(3) or 'no output'}"
            else:
                error = f"ermrun on {host.name} exited with {rc} while the run was open: {node.tail(3)}"
            cooldown = self._pool.failed(name, error)
            self._emit("failure", host, f"node {node.node_id} failed: {error}", rc=rc, error=error)
            if cooldown is not None:
                self._emit(
                    "blacklist",
                    host,
                    f"host {host.name} blacklisted for {cooldown:g}s after "
                    f"{self._pool.failures_to_blacklist} failure(s) in a row",
                    cooldown_s=cooldown,
                )

    def _note_registrations(self, state: RunState, ended=()) -> None:
        """A node whose agent registered ran on its host: the host's count of failures in a row starts
        over. ``ended``: nodes found ended at this poll, which may have registered since the last one
        (their agents' keys outlive them by the lease)."""
        for node in [*self.nodes.values(), *ended]:
            if not node.registered and among(node.node_id, state.node_ids):
                node.registered = True
                self._ever_registered = True
                self._pool.succeeded(node.host.name)

    def _enforce_stop_deadlines(self, now: float) -> None:
        for node in self.nodes.values():
            asked = node.stop_requested_at
            if asked is not None and now - asked > self._cfg.stop_grace_s + 10 and node.poll() is None:
                limit = self._cfg.stop_grace_s + 10
                self._say(f"node {node.node_id} did not stop within {limit:g}s; killing its ssh client")
                node.kill()

    def _closing(self, closed: ClosedRecord, now: float) -> int | None:
        if self._closing_deadline is None:
            self._closing_deadline = now + self._cfg.exit_grace_s
            self._events.emit(
                "launch",
                f"run closed by {closed.by}; waiting for {len(self.nodes)} node(s) to exit",
                action="closed",
                by=closed.by,
            )
            self._say(f"run closed by {closed.by}; waiting for {len(self.nodes)} node(s) to exit")
        if self.nodes:
            if now > self._closing_deadline:
                for node in self.nodes.values():
                    self._stop(node, f"the run closed more than {self._cfg.exit_grace_s:g}s ago")
            return None
        return self._verdict(closed)

    def _verdict(self, closed: ClosedRecord) -> int:
        """The exit status of the node that closed the run: it ended the job, successfully or not."""
        closer = [rc for node_id, rc in self.exit_codes.items() if same_node(node_id, closed.by)]
        if closer:
            rc = closer[0]
            self._say(f"job {'finished' if rc == 0 else f'failed (node {closed.by} exited with {rc})'}")
            return 0 if rc == 0 else 1
        self._say(f"the run was closed by {closed.by}, which erm launch did not start; assuming success")
        return 0

    def _check_idle(self, now: float) -> int | None:
        if self.nodes or self._pool.free():
            self._idle_since = None
            return None
        failures = [
            f"{n}: {self._pool.get(n).last_error}" for n in self._pool.names() if self._pool.get(n).last_error
        ]
        if (
            not self._ever_registered
            and self._pool.names()
            and all(self._pool.blacklisted(n) for n in self._pool.names())
        ):
            self._say("no host could start a node; every host is blacklisted:\n  " + "\n  ".join(failures))
            return 1
        self._idle_since = self._idle_since or now
        if now - self._idle_since > self._cfg.idle_timeout_s:
            self._say(
                f"no node running and no host to start one on for {self._cfg.idle_timeout_s:g}s "
                "(--idle-timeout); giving up. Last failures:\n  " + ("\n  ".join(failures) or "none")
            )
            return 1
        return None

    def _refresh_hosts(self) -> None:
        assert self._discover is not None
        try:
            hosts = self._discover()
        except (DiscoveryError, HostfileError) as exc:
            # once per spell of failures (docs/launch.md: "warns once"), not once per distinct message: a
            # script whose stderr differs at each run (a time in it) was warned about at every poll
            if not self._discovery_failing:
                self._discovery_failing = True
                self._say(f"warning: {exc}; keeping the last host list")
            return
        self._discovery_failing = False
        diff = diff_hosts(self._known, hosts)
        self._known = hosts
        for host in diff.removed:
            self._pool.remove(host.name)
            self._emit("host-removed", host, f"host {host.name} left the discovery output")
            node = self.nodes.get(host.name)
            if node is not None:
                self._stop(node, "its host left the discovery output")
        for host in (*diff.changed, *diff.added):
            self._pool.add(host)
            if host.name in self.nodes:
                # back while its previous node still stops (a flapping discovery answer, a hostfile line
                # deleted and restored): busy until that node ended, or a second node would start there
                # under the same id and the first one would no longer be followed (nor stopped at the end)
                self._pool.take(host.name)
        for host in diff.added:
            self._emit(
                "host-added", host, f"host {host.name} ({host.where()}) appeared in the discovery output"
            )
        for host in diff.changed:
            self._emit(
                "host-changed", host, f"host {host.name} changed to {host.where()} (applies to its next node)"
            )

    def stop_all(self, reason: str) -> list[str]:
        """Stop every node in parallel: each host's supervisor stops its ermrun (SIGTERM, killed after the
        stop grace); an ssh client still there 10 s later is killed here. A signal during the stop
        (interrupts.py) kills every host's ermrun at once; one more returns without waiting. Returns the
        hosts whose node was not seen to end, named for the user with how to stop them; a later call
        returns the same."""
        if self._left is not None:
            return self._left
        self._interrupts.stop()
        for node in list(self.nodes.values()):
            if self._interrupts.hurry:
                break  # every node is killed below
            self._stop(node, reason)
        deadline, hurried = time.monotonic() + self._cfg.stop_grace_s + 10, False
        while self.nodes and time.monotonic() < deadline:
            if self._interrupts.hurry and not hurried:
                hurried, deadline = True, min(deadline, time.monotonic() + KILL_WAIT_S)
                self._say(f"killing the node(s) on {', '.join(self.nodes)} now (ermrun and its workers)")
                for node in self.nodes.values():
                    node.kill_now()
            for name, node in list(self.nodes.items()):
                rc = node.poll()
                if rc is not None:
                    del self.nodes[name]
                    self._pool.release(name)
                    self.exit_codes[node.node_id] = rc
                    self._emit("stopped", node.host, f"node {node.node_id} stopped (exit {rc})", rc=rc)
            if self._interrupts.leave:
                break
            time.sleep(0.1)
        self._left = sorted(self.nodes)
        if self._interrupts.leave and self.nodes:
            pids = " ".join(str(node.pid) for node in self.nodes.values())
            self._say(
                f"node(s) on {', '.join(self._left)} may still run; their ssh client(s) still run here: "
                f"`kill {pids}` ends them, and each host's supervisor then stops its ermrun"
            )
        elif self.nodes:
            for node in self.nodes.values():
                self._say(f"node {node.node_id} did not stop in time; killing its ssh client")
                node.kill()
            self._say(
                f"node(s) on {', '.join(self._left)} may still run: each host's supervisor stops its ermrun "
                "once it sees its ssh connection end (killing it after --stop-grace)"
            )
        self.nodes.clear()
        return self._left

    # -- reporting --------------------------------------------------------------------------------------

    def _emit(self, action: str, host: Host, message: str, **data) -> None:
        self._events.emit(
            "launch",
            message,
            action=action,
            host=host.name,
            addr=host.addr,
            node=host.node_id,
            labels=host.labels,
            **data,
        )
        self._say(message)

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            self._say(f"warning: {message}")
