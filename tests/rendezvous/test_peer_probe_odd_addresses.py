"""A peer whose record names an address this node cannot resolve (the default address is the host's FQDN,
socket.getfqdn(), which other hosts may not resolve; or a mistyped --local-addr) is a peer without an
answer. It used to raise socket.gaierror out of the probe: every probe of the node's other peers failed
with it (a dead peer's refused port was never reported, dead_peers.py), and at the rejoin gate the error
left next_rendezvous() itself, ending the agent."""

from __future__ import annotations

import threading
from dataclasses import replace

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rm.rendezvous.handler import ElasticRMRendezvousHandler
from elastic_rm.rendezvous.peer_sockets import NO_ANSWER, OK, REFUSED, probe_outcomes
from elastic_rm.rendezvous.registration import create_handler
from elastic_rm.rendezvous.rejoin_gate import wait_to_rejoin
from tests.rendezvous.test_handler import join_all, make
from tests.rendezvous.test_peer_probe import Acceptor

UNRESOLVABLE = "no-such-host.invalid"  # RFC 2606: never resolves


def test_an_unresolvable_peer_address_is_no_answer_and_the_other_peers_are_still_probed():
    up, down = Acceptor(), Acceptor()
    down.close()
    try:
        got = probe_outcomes(
            {
                "up": ("127.0.0.1", up.port),
                "nameless": (UNRESOLVABLE, up.port),
                "down": ("127.0.0.1", down.port),
            }
        )
        assert got == {"up": OK, "nameless": NO_ANSWER, "down": REFUSED}
    finally:
        up.close()


def test_the_rejoin_gate_treats_an_unresolvable_peer_as_unreachable_instead_of_raising(etcd, run_id):
    servers = {name: Acceptor() for name in "ab"}
    a = make(etcd, run_id, 2, 2, node_id="a", peer_probe="1")
    params = RendezvousParameters(
        "elastic-rm", etcd.endpoint, run_id, 2, 2, local_addr=UNRESOLVABLE, lease_ttl="1",
        last_call_timeout="0.3", join_timeout="3", node_id="b", peer_probe="1",
    )  # fmt: skip
    b = create_handler(params)
    assert isinstance(b, ElasticRMRendezvousHandler)
    try:
        for name, h in (("a", a), ("b", b)):
            h.services.set_checkpoint_endpoint(servers[name].port, "token")
        join_all([a, b])  # both records now name their checkpoint server: b's under an unresolvable name
        done: dict[str, object] = {}

        def gate() -> None:
            try:
                wait_to_rejoin(a._client, a._session, 0.2)
                done["ok"] = True
            except Exception as exc:  # noqa: BLE001 - the bug: reported by the test
                done["error"] = exc

        a._session.settings = replace(a._session.settings, join_timeout=2.0)  # the gate's bound
        t = threading.Thread(target=gate)
        t.start()
        t.join(30)
        assert not t.is_alive()
        assert "error" not in done, f"the gate raised {done.get('error')!r}"
        assert done == {"ok": True}  # it waited (b never answers) until join_timeout, then let a rejoin
    finally:
        for h in (a, b):
            h.release()
        for s in servers.values():
            s.close()
