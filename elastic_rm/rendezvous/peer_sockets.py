"""Which of its round's peers a node probes, and the probe: a TCP connect to each one's checkpoint server.

Why the checkpoint server: every node with node services runs one, and its address and port are in the
node's record, so a connect to it tests the very link the node's workers use to reach that host. A
connect that the host refuses (nothing listens there: the peer's agent is dead) is told apart from one
without an answer (a cut link, a host gone): elastic_rm.rendezvous.dead_peers acts on the first.
A large run costs each node a constant number of connects: it probes a sample of its peers.
"""

from __future__ import annotations

import errno
import random
import selectors
import socket
import time
from collections.abc import Iterable

from ..etcd.client import EtcdClient
from ..etcd.types import KeyValue
from ..wire.records import NodeRecord, RecordError

# A lost SYN is sent again after 1 s: the timeout lets one retransmission through, so that packet loss
# alone seldom fails a probe (docs/benchmarks.md, probe_loss)
CONNECT_TIMEOUT_S = 1.5
# Peers probed per node: all of them up to this many, else a uniform random sample of this size (kept across
# rounds where it may be: resample), so that a large job costs each node a constant number of connects,
# and no peer gets N of them.
MAX_PROBED_PEERS = 8

Target = tuple[str, int]  # (addr, checkpoint server port)

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
                try:
                    sock = socket.socket(family, socket.SOCK_STREAM)
                except OSError:  # no IPv6 on this host: that peer cannot be reached from here
                    continue
                sock.setblocking(False)
                pending[sock] = node
                try:
                    code = sock.connect_ex((addr, port))
                except OSError:
                    # a name this host cannot resolve (socket.gaierror): no answer, not a refusal. Raised,
                    # it failed the probe of every other peer too, and left next_rendezvous() at the gate
                    continue
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

    Why: the node reads the records of the added peers only. A sample drawn afresh each round would make
    every node read ``k`` records at every round change; kept, a round that changes few members costs a
    few reads. Uniform: how many newcomers the sample takes is drawn as in a fresh
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
    Only these: reading every node's record would cost each node of a large run a read per node on every
    round change."""
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
