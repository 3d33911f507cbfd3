"""A peer whose checkpoint port is refused is dead (elastic_rm/rendezvous/dead_peers.py): real sockets, real
handlers on a real etcd. The leases here live 60 s, so a round without the dead node can only come from the
revocation."""

from __future__ import annotations

import threading

import pytest

from elastic_rm.obs.events import read_etcd
from elastic_rm.rendezvous.dead_peers import REFUSED_PROBES, enough
from elastic_rm.rendezvous.peer_sockets import NO_ANSWER, OK, REFUSED, probe_outcomes
from tests.rendezvous.test_handler import join_all, make, wait_for
from tests.rendezvous.test_peer_probe import Acceptor, BlackHole

TTL = "60"


def test_two_reporters_take_a_peer_out_and_in_a_round_of_two_rank_0_alone():
    assert enough(("a", "b", "c"), {"a", "b"}) and enough(("a", "b", "c", "d"), {"c", "d", "x"})
    assert not enough(("a", "b", "c"), {"a"}) and not enough(("a", "b", "c"), set())
    assert enough(("a", "b"), {"a"})  # rank 0 of two: the only prober, kept by the cut-off rule too
    assert not enough(("a", "b"), {"b"})  # rank 1 alone does not take rank 0 out: the TTL does


def test_probes_tell_a_refused_port_from_one_that_does_not_answer():
    up, hole, gone = Acceptor(), BlackHole(), Acceptor()
    gone.close()
    try:
        got = probe_outcomes(
            {n: ("127.0.0.1", s.port) for n, s in (("up", up), ("hole", hole), ("gone", gone))}, 0.3
        )
        assert got == {"up": OK, "hole": NO_ANSWER, "gone": REFUSED}
        assert probe_outcomes({}) == {}
    finally:
        up.close()
        hole.close()


def _leases(h) -> dict[str, int]:
    kvs, _ = h._client.get_prefix(h.settings.keys.nodes)
    return {kv.key.rsplit("/", 1)[-1]: kv.lease for kv in kvs}


def _refused_twice(h, peer: str, leases: dict[str, int]) -> None:
    """What the probe thread does on a probe that answers, then REFUSED_PROBES in a row that find ``peer``
    refused."""
    h._probe.refusals.observe(h.joined_round.members, set(), leases)
    for _ in range(REFUSED_PROBES):
        h._probe.refusals.observe(h.joined_round.members, {peer}, leases)


def test_a_peer_is_revoked_once_two_reporters_name_its_lease_and_not_before(etcd, run_id):
    """Driven by hand (no checkpoint endpoints, so the probe threads have no targets): one report is not
    enough in a round of three; the second revokes; a report naming an old lease counts for nothing."""
    handlers = {n: make(etcd, run_id, 3, 3, node_id=n, lease_ttl=TTL) for n in "abc"}
    try:
        join_all(list(handlers.values()))
        a, b, c = (handlers[n] for n in "abc")
        leases = _leases(a)
        _refused_twice(a, "c", {**leases, "c": leases["c"] + 1})  # a lease c no longer holds
        _refused_twice(b, "c", leases)
        assert c._client.get(c.settings.keys.node("c")) is not None, "one report on its lease is not enough"
        kvs, _ = a._client.get_prefix(a.settings.keys.refused("c"))
        assert sorted(kv.key.rsplit("/", 1)[-1] for kv in kvs) == ["a", "b"]
        _refused_twice(a, "c", leases)
        assert c._client.get(c.settings.keys.node("c")) is None, "two reports: c's lease is revoked"
        assert a._client.get_prefix(a.settings.keys.refused("c"))[0] == []  # the reports are dropped

        def failures():
            events, _, _ = read_etcd(a._client, a.settings.keys)
            return [e for e in events if e.kind == "failure" and e.data.get("node") == "c"]

        assert wait_for(failures, timeout=10), "no failure event for c"
        (failure,) = failures()
        assert failure.data["reporters"] == ["a", "b"] and "refused" in failure.message
        # the survivors' round, long before the 60 s TTL
        assert wait_for(lambda: a.num_nodes_waiting() > 0, timeout=20)
    finally:
        for h in handlers.values():
            h.shutdown()


def test_in_a_round_of_two_rank_0_revokes_rank_1_and_rank_1_leaves_rank_0_to_the_ttl(etcd, run_id):
    handlers = {n: make(etcd, run_id, 1, 2, node_id=n, lease_ttl=TTL) for n in "ab"}
    try:
        join_all(list(handlers.values()))
        first, second = handlers["a"].joined_round.members
        h0, h1 = handlers[first], handlers[second]
        leases = _leases(h0)
        _refused_twice(h1, first, leases)
        assert h0._client.get(h0.settings.keys.node(first)) is not None
        _refused_twice(h0, second, leases)
        assert h0._client.get(h0.settings.keys.node(second)) is None
    finally:
        for h in handlers.values():
            h.shutdown()


def _die(h, server) -> None:
    """SIGKILL's effect on a node: its checkpoint port closes, its lease lives on (neither refreshed nor
    revoked), its threads stop."""
    server.close()
    h._shut = True
    h._probe.stop()
    h._session.lease.stop()
    h._leader.stop()
    h._view.stop()
    h._client.close()


@pytest.mark.parametrize("victim", ["member", "leader"])
def test_a_killed_node_is_out_of_the_next_round_long_before_its_ttl(etcd, run_id, victim):
    """Three nodes with real checkpoint ports and probe threads; one dies as SIGKILL leaves it. The other
    two find its port refused and revoke its lease: their round of two comes though the lease had 60 s."""
    servers = {n: Acceptor() for n in "abc"}
    handlers = {n: make(etcd, run_id, 2, 3, node_id=n, lease_ttl=TTL) for n in "abc"}
    dead = None
    try:
        for n, h in handlers.items():
            h.services.set_checkpoint_endpoint(servers[n].port, "token")
        join_all(list(handlers.values()))
        dead = next(n for n, h in handlers.items() if h.services.leading == (victim == "leader"))
        rest = [handlers[n] for n in sorted(set(handlers) - {dead})]
        _die(handlers[dead], servers[dead])
        assert wait_for(lambda: rest[0].num_nodes_waiting() > 0, timeout=20), "no round without the dead node"
        two = join_all(rest)
        assert {i.world_size for i in two.values()} == {2}
        assert sorted(rest[0].joined_round.members) == sorted(set(handlers) - {dead})
        assert not any(h._session.lease_lost for h in rest)
    finally:
        for n, h in handlers.items():
            if n != dead:
                h.shutdown()
        for s in servers.values():
            s.close()


def test_a_node_its_peers_revoked_while_it_was_cut_off_waits_at_the_gate(etcd, run_id):
    """Its peers may find it refused (a firewall that rejects) and revoke its lease before its own window
    would have stepped it out: it must not rejoin while it still cannot reach them."""
    servers = {n: Acceptor() for n in "abc"}
    handlers = {n: make(etcd, run_id, 2, 3, node_id=n, lease_ttl=TTL, peer_probe="1000") for n in "abc"}
    try:
        for n, h in handlers.items():
            h.services.set_checkpoint_endpoint(servers[n].port, "token")
        join_all(list(handlers.values()))
        c = handlers["c"]
        rest = [handlers["a"], handlers["b"]]
        holes = {n: BlackHole.replacing(servers[n]) for n in "ab"}  # c reaches neither (nor they each other)
        assert wait_for(lambda: c._probe.cut_now, timeout=20), "the probe never found c cut off"
        c._client.lease_revoke(c._session.lease.id)  # what its peers' reports would do
        assert not c._session.lease.check()  # what its next keep-alive finds (up to TTL / 3 = 20 s later)
        assert c._session.lease_lost
        box: dict = {}
        t = threading.Thread(target=lambda: box.update(info=c.next_rendezvous()), daemon=True)
        t.start()
        two = join_all(rest)
        assert {i.world_size for i in two.values()} == {2}
        assert t.is_alive() and "info" not in box, "c rejoined while it could not reach its peers"
        for n in "ab":
            holes[n].close()
            servers[n] = Acceptor(servers[n].port)
        assert wait_for(lambda: rest[0].num_nodes_waiting() > 0, timeout=20), "no round with c after the heal"
        join_all(rest)
        t.join(30)
        assert "info" in box and box["info"].world_size == 3
    finally:
        for h in handlers.values():
            h.shutdown()
        for s in servers.values():
            s.close()
