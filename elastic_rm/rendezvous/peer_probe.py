"""A node that reaches etcd but not its peers steps out of the run, and comes back once it reaches them.

Why: with its link to the other hosts cut but etcd reachable, a node keeps its lease, so no round ever
leaves it out; every member then waits in gloo collectives for minutes. Each node probes the checkpoint
servers of its round's other members (a TCP connect, every ``PROBE_INTERVAL_S``). When more than half of
at least 2 peers fail every probe of them for the window (``--rdzv-conf peer_probe``; ``CutOffClock``: a
lossy link fails a probe now and then, a cut one every probe), the node revokes its own lease: the leader
sees a lost member, the others train on without it, and its agent stops its workers and rejoins. A peer
that is gone from etcd does not count (its lease ended: the leader replaces it anyway).
A peer whose host refuses the connect (nothing listens there: its agent is dead) is also reported, and
its lease revoked once a quorum of probers agrees (dead_peers.py).

A tie has no majority: two members that cannot reach each other (a round of two), or a node that cannot
reach exactly half of its peers (in a round of three, the link between two of them cut). Both sides see
the same, so a deterministic rule decides: the node steps out when one of the peers it cannot reach comes
before it in the round's member list (a lower group rank); the earlier one stays. Of two hosts cut apart,
group rank 1 leaves and group rank 0 trains on alone. A tie must hold for ``TIE_WINDOWS`` windows: when a
node is cut off from all its peers, each of them sees a tie against it, and the cut-off node (a majority
after one window) must have left first (its peers then no longer count it: it is gone from etcd).

The trap is the rejoin: a node readmitted while still cut off stalls the next round too, over and over. So
before a node that stepped out registers again, :meth:`PeerProbe.gate` waits (bounded by join_timeout)
until that rule no longer holds against the run's other live nodes.
"""

from __future__ import annotations

import errno
import logging
import random
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable

from ..background import Background
from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..etcd.types import KeyValue
from ..wire.records import NodeRecord, RecordError
from .dead_peers import RefusalReports
from .session import NodeSession

log = logging.getLogger(__name__)

PROBE_INTERVAL_S = 1.0
# after a refused connect, the next probe comes this soon: a dead peer is reported (dead_peers.py) without
# waiting a whole interval, while a healthy run costs each node one round of connects a second
CONFIRM_S = 0.2
# A lost SYN is sent again after 1 s: with 10% loss on every link, 33.7% of connects failed within 0.5 s,
# 7.0% within 1.5 s (benchmarks/probe_loss, probe-loss.json)
CONNECT_TIMEOUT_S = 1.5
GATE_LOG_EVERY_S = 10.0
# Peers probed per node: all of them up to this many, else a uniform random sample of this size (kept across
# rounds where it may be: resample), so that a large job costs each node a constant number of connects,
# and no peer gets N of them.
MAX_PROBED_PEERS = 8
TIE_WINDOWS = 2  # a tie steps a node out after this many windows (a majority after one)
MAJORITY_PROBES, TIE_PROBES = 2, 3  # failed probes in a row, at least, before a peer counts (CutOffClock)

Target = tuple[str, int]  # (addr, checkpoint server port)


def cut_off(peers: int, unreachable: int, outranked: bool = False) -> bool:
    """The rule: more than half of at least 2 peers unreachable; or a tie (exactly half, one peer of one
    included) when ``outranked``: an unreachable peer has a lower group rank than this node."""
    if unreachable <= 0:
        return False
    if peers >= 2 and 2 * unreachable > peers:
        return True
    return outranked and 2 * unreachable >= peers


def holds_back(peers: int, unreachable: int) -> bool:
    """Whether a node that stepped out must wait before rejoining: it does not reach more than half of the
    run's other live nodes (a tie included: rejoining then would only lead to the same tie again)."""
    return unreachable > 0 and 2 * unreachable >= peers


def outranked(members: tuple[str, ...] | list[str], node: str, unreachable: set[str]) -> bool:
    """Whether one of the ``unreachable`` peers comes before ``node`` in the round's ``members``."""
    return bool(unreachable & ranked_before(members, node))


def ranked_before(members: tuple[str, ...] | list[str], node: str) -> set[str]:
    """The members before ``node`` in the round's list (none when it is not a member: no rank to compare)."""
    return set(members[: members.index(node)]) if node in members else set()


class CutOffClock:
    """Since when each probed peer has failed every probe of it; pure (the caller passes the time).

    Why per peer: under packet loss any one connect fails now and then, and a rule checked on each probe's
    count alone took a node out when different peers failed in turn (two of two peers failed one probe
    or another for the whole window). A peer counts as unreachable once every probe of it failed for the
    window, ``MAJORITY_PROBES`` probes at least; for a tie, two windows and ``TIE_PROBES`` probes."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._silent: dict[str, tuple[float, int]] = {}  # peer -> (its first failed probe in a row, how many)

    def observe(
        self, now: float, probed: Iterable[str], lost: set[str], earlier: set[str] = frozenset()
    ) -> set[str]:
        """Record a probe of ``probed`` (``lost``: those that failed); return the peers that take this node
        out (``cut_off``, a tie when one of them is ``earlier`` in the round), else an empty set."""
        probed = list(probed)
        self._silent = {n: self._failed_again(n, now) for n in probed if n in lost}
        return self.verdict(now, len(probed), earlier)

    def verdict(self, now: float, peers: int, earlier: set[str] = frozenset()) -> set[str]:
        silent = self._silent_for(now, 1, MAJORITY_PROBES)
        if cut_off(peers, len(silent)):
            return silent
        tied = self._silent_for(now, TIE_WINDOWS, TIE_PROBES)
        return tied if cut_off(peers, len(tied), bool(tied & earlier)) else set()

    def reset(self) -> None:
        self._silent = {}

    def _failed_again(self, peer: str, now: float) -> tuple[float, int]:
        since, failed = self._silent.get(peer, (now, 0))
        return since, failed + 1

    def _silent_for(self, now: float, windows: int, probes: int) -> set[str]:
        return {
            n
            for n, (since, failed) in self._silent.items()
            if failed >= probes and now - since >= windows * self.window_s
        }


OK, REFUSED, NO_ANSWER = "ok", "refused", "no answer"


def probe_outcomes(targets: dict[str, Target], timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, str]:
    """Each node of ``targets`` -> OK (its address accepted a TCP connection), REFUSED (its host answered
    that nothing listens there: a reset) or NO_ANSWER (no connection within ``timeout_s``, an unreachable
    network or host). Non-blocking connects in parallel from this thread: a cut-off peer costs the timeout
    once, not once per peer, and no thread is started per probe."""
    out = dict.fromkeys(targets, NO_ANSWER)
    pending: dict[socket.socket, str] = {}
    with selectors.DefaultSelector() as sel:
        try:
            for node, (addr, port) in targets.items():
                family = socket.AF_INET6 if ":" in addr else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                sock.setblocking(False)
                pending[sock] = node
                code = sock.connect_ex((addr, port))
                if code in (0, errno.EINPROGRESS, errno.EAGAIN):
                    sel.register(sock, selectors.EVENT_WRITE)
                else:
                    out[node] = _outcome(code)
            deadline = time.monotonic() + timeout_s
            while sel.get_map() and (left := deadline - time.monotonic()) > 0:
                for key, _ in sel.select(left):
                    sel.unregister(key.fileobj)
                    sock = key.fileobj  # type: ignore[assignment]
                    out[pending[sock]] = _outcome(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR))
        finally:
            for sock in pending:
                sock.close()
    return out


def _outcome(code: int) -> str:
    return OK if code == 0 else REFUSED if code == errno.ECONNREFUSED else NO_ANSWER


def unreachable_of(targets: dict[str, Target], timeout_s: float = CONNECT_TIMEOUT_S) -> set[str]:
    """The nodes of ``targets`` whose address does not accept a TCP connection within ``timeout_s``."""
    return {n for n, outcome in probe_outcomes(targets, timeout_s).items() if outcome != OK}


def probe_sample(targets: dict[str, Target], k: int = MAX_PROBED_PEERS) -> dict[str, Target]:
    """``targets`` when it has at most ``k`` nodes, else ``k`` of them at random: the majority rule holds
    on a sample as well (a node cut off from all its peers fails every probe)."""
    if len(targets) <= k:
        return targets
    return {n: targets[n] for n in random.sample(sorted(targets), k)}


def resample(
    sample: Iterable[str], before: set[str], members: list[str], k: int = MAX_PROBED_PEERS, rng=random
) -> tuple[list[str], list[str]]:
    """A uniform random sample of ``k`` of ``members`` (this node's round peers) that keeps as much of
    ``sample`` (drawn from ``before``, the peers of the last round) as a uniform sample may: (kept, added).

    Why: the node reads the records of the added peers only. Drawing afresh each round made every node
    read ``k`` records per round (8,192 reads at 1,024 nodes, at every round change); kept, a round that
    changes few members costs a few. Uniform: how many newcomers the sample takes is drawn as in a fresh
    sample of ``members``, so a node that joins a large run is probed by about ``k`` peers, like the rest."""
    if len(members) <= k:
        current = set(members)
        kept = [n for n in sample if n in current]
        return kept, [n for n in members if n not in set(kept)]
    newcomers = [n for n in members if n not in before]
    stayed = [n for n in members if n in before]
    taken = sum(1 for i in rng.sample(range(len(members)), k) if i < len(newcomers))
    added = rng.sample(newcomers, taken)
    remaining = set(stayed)
    kept = [n for n in sample if n in remaining]
    if len(kept) > k - taken:
        kept = rng.sample(kept, k - taken)
    else:
        remaining -= set(kept)
        added += rng.sample([n for n in stayed if n in remaining], k - taken - len(kept))
    return kept, added


def read_targets(
    client: EtcdClient, nodes_prefix: str, names: list[str], exclude: str
) -> tuple[dict[str, Target], dict[str, int]]:
    """The records of ``names``, read at once: those alive and serving checkpoints, and their leases.
    Reading every node's record instead made each of 1,024 nodes read 1,024 records on every round (the
    scale benchmark's profile: a third of a node process's CPU while rounds changed)."""
    kvs = client.get_many([nodes_prefix + n for n in names])
    targets = serving(kvs, exclude)
    return targets, {n: kv.lease for kv in kvs if (n := kv.key[len(nodes_prefix) :]) in targets}


def live_targets(client: EtcdClient, nodes_prefix: str, exclude: str) -> dict[str, Target]:
    """Every live node of the run but ``exclude`` that serves checkpoints: node -> (addr, port)."""
    kvs, _ = client.get_prefix(nodes_prefix)
    return serving(kvs, exclude)


def serving(kvs: Iterable[KeyValue], exclude: str) -> dict[str, Target]:
    """The nodes among these records, but ``exclude``, that serve checkpoints (malformed records skipped)."""
    out = {}
    for kv in kvs:
        try:
            rec = NodeRecord.parse(kv.key, kv.value)
        except RecordError:
            continue
        if rec.node != exclude and rec.ckpt_port:
            out[rec.node] = (rec.addr, rec.ckpt_port)
    return out


class PeerProbe:
    """Probes this node's round peers while it trains; steps out when cut off; gates its rejoin."""

    def __init__(
        self,
        client: EtcdClient,
        session: NodeSession,
        window_s: float,
        newer_round: Callable[[], bool],
        interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        """``newer_round``: whether a round after the joined one is pending (then no step-out is needed)."""
        self._client = client
        self._session = session
        self._nodes = session.settings.keys.nodes
        self._newer_round = newer_round
        self._interval_s = interval_s
        self.clock = CutOffClock(window_s)
        self.refusals = RefusalReports(client, session)  # peers refused: dead, revoked early (dead_peers.py)
        self._leases: dict[str, int] = {}  # each target's lease, as its record was read
        self._members: set[str] = set()  # the round peers the targets were sampled from
        self._lost: set[str] = set()  # the targets that did not answer the last probe
        # the rule held at the last probe: a node whose peers revoked its lease (dead_peers.py) while it
        # could not reach them is gated like one that stepped out
        self.cut_now = False
        self.stepped_out = threading.Event()
        self._thread = Background(self._loop, "erm-peer-probe")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._thread.stop(timeout_s=2 * CONNECT_TIMEOUT_S + 1)

    # -- while training -------------------------------------------------------------------------------

    def _loop(self, stopping: threading.Event) -> None:
        round_seen, targets = 0, {}
        wait = self._interval_s
        while not stopping.wait(wait):
            try:
                round_seen, targets = self._tick(round_seen, targets)
            except EtcdError as exc:  # etcd down is not our concern here (the lease handles it)
                log.debug("peer probe: %s", exc)
            except Exception:  # noqa: BLE001 - a probe must never take the node down
                log.exception("peer probe failed")
            wait = CONFIRM_S if self.refusals.confirming else self._interval_s

    def _tick(self, round_seen: int, targets: dict[str, Target]) -> tuple[int, dict[str, Target]]:
        session = self._session
        joined = session.joined
        if session.released or joined is None or session.live_lease_id() is None or self.stepped_out.is_set():
            self.clock.reset()
            return 0, {}
        if joined.round != round_seen:
            self.clock.reset()
            self.refusals.reset()
            targets = self._resample([m for m in joined.members if m != session.node_id], targets)
            round_seen = joined.round
        outcomes = probe_outcomes(targets)
        lost = self._lost = {n for n, outcome in outcomes.items() if outcome != OK}
        self.refusals.observe(joined.members, {n for n in lost if outcomes[n] == REFUSED}, self._leases)
        earlier = ranked_before(joined.members, session.node_id)
        self.cut_now = cut_off(len(targets), len(lost), bool(lost & earlier))
        if unreachable := self.clock.observe(time.monotonic(), targets, lost, earlier):
            self.clock.reset()
            self._maybe_step_out(targets, unreachable)
        return round_seen, targets

    def _resample(self, members: list[str], targets: dict[str, Target]) -> dict[str, Target]:
        """This round's targets: the last round's sample, kept where it may be, and new peers, whose records
        are read, with those of kept peers that did not answer the last probe (their record may have
        changed: a process restarted under the same node id)."""
        kept, added = resample(targets, self._members, members)
        stale = [n for n in kept if n in self._lost]
        fresh, leases = read_targets(self._client, self._nodes, added + stale, self._session.node_id)
        kept = [n for n in kept if n not in stale]
        self._leases = {n: self._leases[n] for n in kept} | leases
        self._members = set(members)
        return {n: targets[n] for n in kept} | fresh

    def _maybe_step_out(self, targets: dict[str, Target], lost: set[str]) -> None:
        """Confirm with etcd (peers gone from it do not count; a pending newer round settles it), then revoke
        this node's lease."""
        if self._newer_round():
            return
        live = set(live_targets(self._client, self._nodes, self._session.node_id))
        peers, lost = set(targets) & live, lost & live
        session, lease = self._session, self._session.lease
        if lease is None or session.joined is None:
            return
        later = outranked(session.joined.members, session.node_id, lost)
        if not cut_off(len(peers), len(lost), later):
            return
        tie = not cut_off(len(peers), len(lost))  # it leaves by the tie-break, not by a majority
        window = self.clock.window_s * (TIE_WINDOWS if tie else 1)
        why = (
            " (a tie: a peer it cannot reach ranks before it in the round, so this node leaves)"
            if tie
            else ""
        )
        message = (
            f"cannot reach {len(lost)} of {len(peers)} peers ({', '.join(sorted(lost))}) for {window:g}s while "
            f"etcd answers{why}: leaving the run (revoking this node's lease); it rejoins once it reaches them"
        )
        log.warning("node %s %s", session.node_id, message)
        session.events.emit("node", message, unreachable=sorted(lost), peers=len(peers), window_s=window)
        self.stepped_out.set()
        lease.revoke()

    # -- before rejoining -----------------------------------------------------------------------------

    def gate(self) -> None:
        """Called before a node whose lease is gone registers again: after a step-out, wait until it reaches
        more than half of the run's other live nodes (``holds_back``; at most join_timeout, then it rejoins
        anyway, with a warning); so too when its last probe found it cut off (its peers may have revoked its
        lease first: dead_peers.py). Returns at once for a lease lost any other way."""
        if not self.stepped_out.is_set() and not self.cut_now:
            return
        session = self._session
        timeout = session.settings.join_timeout
        t0 = time.monotonic()
        next_log = t0 + GATE_LOG_EVERY_S
        while not session.released:
            try:
                targets = probe_sample(live_targets(self._client, self._nodes, session.node_id))
                lost = unreachable_of(targets)
                if not holds_back(len(targets), len(lost)):
                    waited = time.monotonic() - t0
                    message = f"reaches {len(targets) - len(lost)} of {len(targets)} peers again after {waited:.1f}s: rejoining"
                    log.warning("node %s %s", session.node_id, message)  # the end of the step-out
                    session.events.emit("node", message, waited_s=round(waited, 3))
                    break
            except EtcdError as exc:
                log.debug("peer probe gate: %s", exc)
                lost = set()
            now = time.monotonic()
            if now - t0 > timeout:
                log.warning(
                    "node %s still cannot reach its peers after %.0fs (join_timeout): rejoining anyway",
                    session.node_id, now - t0,
                )  # fmt: skip
                break
            if now >= next_log:
                next_log = now + GATE_LOG_EVERY_S
                log.warning(
                    "node %s waits to reach its peers before rejoining (unreachable: %s)",
                    session.node_id, ", ".join(sorted(lost)) or "?",
                )  # fmt: skip
            time.sleep(self._interval_s)
        self.stepped_out.clear()
        self.cut_now = False
