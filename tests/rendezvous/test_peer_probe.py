"""The peer probe (elastic_rm/rendezvous/peer_probe.py, with peer_quorum.py, peer_sockets.py and
rejoin_gate.py): the cut-off rule, real TCP probes, and three real handlers on a real etcd where one
node's peers stop answering it (their checkpoint ports close): it steps out, the other two form a round
without it, and it rejoins only once it reaches them again."""

from __future__ import annotations

import socket
import threading

import pytest

from elastic_rm.rendezvous.peer_quorum import (
    TIE_WINDOWS,
    CutOffClock,
    cut_off,
    holds_back,
    outranked,
    ranked_before,
)
from elastic_rm.rendezvous.peer_sockets import live_targets, unreachable_of
from tests.rendezvous.test_handler import join_all, make, wait_for


@pytest.mark.parametrize(
    ("peers", "unreachable", "out"),
    [(0, 0, False), (1, 1, False), (2, 1, False), (2, 2, True), (3, 1, False), (3, 2, True), (4, 2, False)],
)
def test_the_rule_is_more_than_half_of_at_least_two_peers(peers, unreachable, out):
    assert cut_off(peers, unreachable) is out


@pytest.mark.parametrize(
    ("peers", "unreachable", "out"),
    [(1, 0, False), (1, 1, True), (2, 1, True), (4, 2, True), (3, 1, False), (4, 1, False), (2, 0, False)],
)
def test_a_tie_steps_out_only_the_node_outranked_by_a_peer_it_cannot_reach(peers, unreachable, out):
    assert cut_off(peers, unreachable, outranked=True) is out
    assert cut_off(peers, unreachable, outranked=False) is (peers >= 2 and 2 * unreachable > peers)


def test_of_two_members_cut_apart_the_later_one_leaves_and_a_tie_holds_back_its_rejoin():
    members = ("h0", "h1", "h2")
    assert outranked(members[:2], "h1", {"h0"}) and not outranked(members[:2], "h0", {"h1"})
    assert outranked(members, "h2", {"h1"}) and not outranked(members, "h1", {"h2"})  # the h1-h2 link cut
    assert not outranked(members, "h9", {"h0"})  # not a member (any more): no rank to compare
    assert ranked_before(members, "h2") == {"h0", "h1"} and ranked_before(members, "h9") == set()
    assert holds_back(1, 1) and holds_back(2, 1) and holds_back(3, 2)
    assert not holds_back(1, 0) and not holds_back(3, 1) and not holds_back(0, 0)


def test_a_peer_counts_once_every_probe_of_it_failed_for_the_window():
    clock = CutOffClock(window_s=3.0)
    peers = ["a", "b", "c"]
    assert not clock.observe(10.0, peers, {"a", "b"})
    assert not clock.observe(12.9, peers, {"a", "b"})
    assert not clock.observe(13.0, peers, {"a"})  # b answered: its count starts again
    assert not clock.observe(14.0, peers, {"a", "b", "c"})  # a has failed for 4 s, b and c for none
    assert not clock.observe(16.5, peers, {"a", "b", "c"})
    assert clock.observe(17.0, peers, {"a", "b", "c"}) == {"a", "b", "c"}  # b and c: 3 s, a: 7 s
    clock.reset()
    assert not clock.observe(100.0, ["a"], {"a"}) and not clock.observe(200.0, ["a"], {"a"})  # one of one


def test_peers_that_fail_in_turn_never_take_a_node_out():
    """Packet loss: each probe some peer fails, and over the window every peer failed one probe or
    another; no peer failed every probe of it, so the node stays."""
    clock = CutOffClock(window_s=2.0)
    for t in range(100):
        assert not clock.observe(float(t), ["a", "b"], [{"a"}, {"b"}, {"a", "b"}][t % 3])


def test_a_window_shorter_than_the_probe_interval_still_needs_two_failed_probes():
    clock = CutOffClock(window_s=0.1)
    assert not clock.observe(10.0, ["a", "b"], {"a", "b"})  # one failed probe each: not enough
    assert clock.observe(11.0, ["a", "b"], {"a", "b"}) == {"a", "b"}


def test_a_tie_must_hold_for_longer_than_a_majority():
    """A node cut off from all its peers is a tie to each of them: it must leave (a majority, one window)
    before any of them would leave by the tie-break."""
    clock = CutOffClock(window_s=2.0)
    assert not clock.observe(10.0, ["a"], {"a"}, earlier={"a"})
    assert not clock.observe(12.0, ["a"], {"a"}, earlier={"a"})  # one window: not yet for a tie
    assert clock.observe(10.0 + TIE_WINDOWS * 2.0, ["a"], {"a"}, earlier={"a"}) == {"a"}
    clock.reset()
    for t in (10.0, 12.0, 14.0, 16.0):  # the peer it cannot reach ranks after it: it stays
        assert not clock.observe(t, ["a", "b"], {"b"}, earlier={"a"})


def test_a_tie_needs_three_failed_probes():
    clock = CutOffClock(window_s=0.1)
    assert not clock.observe(10.0, ["a"], {"a"}, earlier={"a"})
    assert not clock.observe(11.0, ["a"], {"a"}, earlier={"a"})  # two windows, two probes
    assert clock.observe(12.0, ["a"], {"a"}, earlier={"a"}) == {"a"}


def listening(port: int, backlog: int) -> socket.socket:
    """A socket listening on loopback ``port`` (0: any free one), reusable at once after a close."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(backlog)
    return sock


class Acceptor:
    """A listening socket that accepts and closes connections (a checkpoint server, for the probe)."""

    def __init__(self, port: int = 0) -> None:
        self.sock = listening(port, backlog=16)
        self.port = self.sock.getsockname()[1]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.close()

    def close(self) -> None:
        if self.sock.fileno() == -1:  # closed already
            return
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(5)


class BlackHole:
    """A port whose connects get no answer, as across a cut link (a closed port would be refused instead:
    a dead agent, dead_peers.py): a listening socket with a backlog of one, filled and never accepted; the
    kernel then drops new SYNs."""

    def __init__(self, port: int = 0) -> None:
        self.sock = listening(port, backlog=0)
        self.port = self.sock.getsockname()[1]
        self._fill = []
        for _ in range(2):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", self.port))
            self._fill.append(c)

    @classmethod
    def replacing(cls, server: Acceptor) -> BlackHole:
        server.close()
        return cls(server.port)

    def close(self) -> None:
        for c in self._fill:
            c.close()
        self.sock.close()


def test_probes_are_real_tcp_connects():
    up = Acceptor()
    down = Acceptor()
    down.close()
    try:
        assert unreachable_of({"up": ("127.0.0.1", up.port), "down": ("127.0.0.1", down.port)}) == {"down"}
        assert unreachable_of({}) == set()
    finally:
        up.close()


@pytest.mark.parametrize("role", ["member", "leader"])
def test_a_node_that_reaches_etcd_but_not_its_peers_steps_out_and_rejoins_once_it_reaches_them(
    role, etcd, run_id
):
    """role: the node cut off is a plain member or the run's leader node (another node leads then)."""
    servers = {name: Acceptor() for name in "abc"}
    handlers = {name: make(etcd, run_id, 2, 3, node_id=name, peer_probe="1") for name in "abc"}
    try:
        for name, h in handlers.items():
            h.services.set_checkpoint_endpoint(servers[name].port, "token")
        infos = join_all(list(handlers.values()))
        assert {i.world_size for i in infos.values()} == {3}
        cut = next(n for n, h in handlers.items() if h.services.leading == (role == "leader"))
        rest = sorted(set(handlers) - {cut})
        holes = {}
        for (
            name
        ) in rest:  # the cut node's peers stop answering it (and each other: one of two is no majority)
            holes[name] = BlackHole.replacing(servers[name])
        c = handlers[cut]
        assert wait_for(lambda: c._session.lease_lost, timeout=20), f"{cut} did not step out"
        assert not any(handlers[n]._session.lease_lost for n in rest)
        rejoined = {}
        t = threading.Thread(target=lambda: rejoined.update(info=c.next_rendezvous()))
        t.start()  # it waits at the gate: it must not be readmitted while it cannot reach its peers
        two = join_all([handlers[n] for n in rest])
        assert {i.world_size for i in two.values()} == {2}
        assert t.is_alive() and "info" not in rejoined
        assert c.view.round is not None and sorted(c.view.round.members) == rest
        for name in rest:  # the link heals
            holes[name].close()
            servers[name] = Acceptor(servers[name].port)
        assert wait_for(lambda: handlers[rest[0]].num_nodes_waiting() > 0, timeout=20), f"no round with {cut}"
        three = join_all([handlers[n] for n in rest])
        t.join(30)
        assert "info" in rejoined, f"{cut} did not rejoin after the heal"
        assert {i.world_size for i in three.values()} == {3} and rejoined["info"].world_size == 3
        assert sorted(c.view.round.members) == sorted([*rest, f"{cut}-r1"])
    finally:
        for h in handlers.values():
            h.shutdown()
        for s in servers.values():
            s.close() if s.sock.fileno() != -1 else None


def test_peers_gone_from_etcd_do_not_count_and_live_ones_do(etcd, run_id):
    """The step-out's confirmation with etcd: unreachable peers whose records are gone (their leases ended:
    the leader replaces them anyway) do not take the node out; live ones do."""
    servers = {name: Acceptor() for name in "abc"}
    handlers = {name: make(etcd, run_id, 3, 3, node_id=name, peer_probe="1000") for name in "abc"}
    try:
        for name, h in handlers.items():
            h.services.set_checkpoint_endpoint(servers[name].port, "token")
        join_all(list(handlers.values()))
        # the node ranked first probes: a tie (half of its peers unreachable) never takes it out, only a
        # majority of live peers would (a tie takes out the node outranked by a peer it cannot reach)
        me, x, y = handlers["a"].joined_round.members
        p = handlers[me]
        targets = {n: ("127.0.0.1", servers[n].port) for n in (x, y)}
        p._probe._maybe_step_out(targets, {x})  # one of two: no majority
        assert not p._session.lease_lost
        handlers[y].release()  # y's record goes with its lease: only x counts, one of one is a tie
        assert wait_for(lambda: y not in live_targets(p._client, p.settings.keys.nodes, me))
        p._probe._newer_round = lambda: False  # as if the leader had not written the round without y yet
        p._probe._maybe_step_out(targets, {x, y})  # two of two, but y is gone from etcd: it does not count
        assert not p._session.lease_lost
    finally:
        for h in handlers.values():
            h.shutdown()
        for s in servers.values():
            s.close()


def test_a_node_whose_live_peers_are_unreachable_steps_out(etcd, run_id):
    servers = {name: Acceptor() for name in "abc"}
    handlers = {name: make(etcd, run_id, 2, 3, node_id=name, peer_probe="1000") for name in "abc"}
    try:
        for name, h in handlers.items():
            h.services.set_checkpoint_endpoint(servers[name].port, "token")
        join_all(list(handlers.values()))
        c = handlers["c"]
        c._probe._maybe_step_out({n: ("127.0.0.1", servers[n].port) for n in "ab"}, {"a", "b"})
        assert c._session.lease_lost and c._probe.stepped_out.is_set()
        assert wait_for(lambda: handlers["a"].num_nodes_waiting() > 0)  # the others get a round without c
    finally:
        for h in handlers.values():
            h.shutdown()
        for s in servers.values():
            s.close()


def test_peer_probe_setting_is_validated(etcd, run_id):
    with pytest.raises(ValueError, match="peer_probe"):
        make(etcd, run_id, 1, 1, peer_probe="soon")
    with pytest.raises(ValueError, match="peer_probe"):
        make(etcd, run_id, 1, 1, peer_probe="-1")
    h = make(etcd, run_id, 1, 1, peer_probe="0")  # 0: off
    try:
        assert h._probe is None and h._session.rejoin_gate is None
    finally:
        h.shutdown()


def test_a_large_round_is_probed_through_a_bounded_sample() -> None:
    from elastic_rm.rendezvous.peer_sockets import MAX_PROBED_PEERS, probe_sample

    few = {f"n{i}": ("127.0.0.1", 1000 + i) for i in range(MAX_PROBED_PEERS)}
    assert probe_sample(few) == few
    many = {f"n{i}": ("127.0.0.1", 1000 + i) for i in range(1000)}
    picked = probe_sample(many)
    assert len(picked) == MAX_PROBED_PEERS and all(many[n] == t for n, t in picked.items())


def test_a_large_round_reads_only_the_sampled_peers_records(etcd, run_id) -> None:
    """At 1,024 nodes each node read every node's record on every round; now only those of the peers it
    samples: alive (a record under a lease), serving checkpoints, not itself; with their leases."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.planner.interface import NodeState
    from elastic_rm.rendezvous.peer_sockets import read_targets
    from elastic_rm.wire.keyspace import Keyspace
    from elastic_rm.wire.records import NodeRecord, dumps

    keys = Keyspace("/elastic-rm", run_id)
    members = tuple(f"m{i}" for i in range(40))
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        lease = c.lease_grant(60)[0]
        for i, node in enumerate(members + ("outsider",)):
            port = 0 if i % 4 == 3 else 2000 + i  # every fourth member serves no checkpoints
            record = NodeRecord(node, "h", "127.0.0.1", 1, 1, NodeState.ACTIVE, ckpt_port=port)
            if node != "m5":  # m5 is gone: no record
                c.put(keys.node(node), dumps(record), lease=lease)
        names = ["m0", "m1", "m3", "m5", "m6"]
        targets, leases = read_targets(c, keys.nodes, names, exclude="m0")
        assert targets == {"m1": ("127.0.0.1", 2001), "m6": ("127.0.0.1", 2006)}
        assert leases == {"m1": lease, "m6": lease}
        assert read_targets(c, keys.nodes, [], exclude="m0") == ({}, {})


def test_the_sample_is_kept_across_rounds_and_stays_uniform() -> None:
    """Each node reads the records of the peers it adds to its sample only: a round that changed nothing
    adds none; a departed peer is replaced; newcomers are drawn as often as in a fresh sample."""
    import random

    from elastic_rm.rendezvous.peer_sockets import MAX_PROBED_PEERS as K
    from elastic_rm.rendezvous.peer_sockets import resample

    rng = random.Random(7)
    peers = [f"n{i}" for i in range(100)]
    kept, added = resample([], set(), peers, rng=rng)
    assert kept == [] and len(added) == K and set(added) <= set(peers)
    sample = kept + added
    assert resample(sample, set(peers), peers, rng=rng) == (sample, [])  # nothing changed: no reads
    gone = sample[0]
    rest = [p for p in peers if p != gone]
    kept, added = resample(sample, set(peers), rest, rng=rng)
    assert sorted(kept) == sorted(sample[1:]) and len(added) == 1 and added[0] not in sample
    small = ["a", "b", "c"]
    assert resample(["b", "x"], {"b", "x"}, small, rng=rng) == (["b"], ["a", "c"])  # all of a small round
    # a newcomer to a round of 100 peers is in about K of 100 nodes' samples, as a peer of a fresh draw
    newcomer, draws, hits = "new", 4000, 0
    for _ in range(draws):
        start = rng.sample(peers, K)
        kept, added = resample(start, set(peers), peers + [newcomer], rng=rng)
        assert len(kept) + len(added) == K and set(kept) <= set(start)
        hits += newcomer in added
    assert abs(hits / draws - K / 101) < 0.02, hits / draws
