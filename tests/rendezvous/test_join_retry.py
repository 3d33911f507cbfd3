"""next_rendezvous() across a transient etcd failure, and a lease lost on the way into a round.

Why: at 1,024 nodes on 2 cores, some survivors' joins hit etcd's call timeout and raised
RendezvousConnectionError (the agent then gives up the node), and one returned a rank while its lease had
just expired: ``joined_round`` was None after the call returned (the node had already rejoined as a new
member). A call that times out is retried within join_timeout; a node whose lease is gone joins nothing
under its old id.
"""

from __future__ import annotations

import threading
import time

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.rendezvous.registration import create_handler
from tests.etcd.cutoff_proxy import CutoffProxy


def _handler(endpoint: str, run_id: str, **conf):
    conf = {"lease_ttl": "5", "last_call_timeout": "0.3", "join_timeout": "30", "etcd_timeout": "1", **conf}
    params = RendezvousParameters("elastic-rm", endpoint, run_id, 1, 1, local_addr="127.0.0.1", **conf)
    return create_handler(params)


def test_a_join_retries_an_etcd_call_that_failed_for_a_while_instead_of_raising(etcd, run_id):
    with CutoffProxy(etcd.endpoint) as proxy:
        h = _handler(proxy.endpoint, run_id)
        try:
            proxy.cut()  # etcd unreachable for 2.5 s: longer than etcd_timeout, shorter than the lease
            out: dict = {}

            def join() -> None:
                try:
                    out["info"] = h.next_rendezvous()
                except Exception as exc:  # noqa: BLE001 - asserted below
                    out["error"] = exc

            t = threading.Thread(target=join, daemon=True)
            t.start()
            time.sleep(2.5)
            assert "error" not in out, out  # still trying: not a RendezvousConnectionError
            proxy.heal()
            t.join(30)
            assert "error" not in out, out
            assert out["info"].rank == 0 and out["info"].world_size == 1
            assert h.joined_round is not None and h.node_id in h.joined_round.members
        finally:
            proxy.heal()
            h.release()


def test_a_join_still_fails_clearly_once_join_timeout_passes_without_etcd(etcd, run_id):
    with CutoffProxy(etcd.endpoint) as proxy:
        h = _handler(proxy.endpoint, run_id, join_timeout="3")
        try:
            proxy.cut()
            try:
                h.next_rendezvous()
                raise AssertionError("joined without etcd")
            except RendezvousConnectionError as exc:
                assert proxy.endpoint in str(exc)
        finally:
            proxy.heal()
            h.release()


def test_a_node_whose_lease_is_lost_joins_no_round_under_its_old_id(etcd, run_id):
    h = _handler(etcd.endpoint, run_id, node_id="m0")
    try:
        first = h.next_rendezvous()
        assert first.rank == 0 and h.joined_round is not None
        round_one = h.joined_round
        lease = h._session.lease
        lease.stop()
        with EtcdClient(etcd.endpoint, timeout=2) as other:
            other.lease_revoke(lease.id)  # as etcd does when the TTL passes
        lease.mark_lost()  # the keeper noticed, between the round's arrival and the join
        assert h._join(round_one) is None  # no rank in a round that names the old id
        assert h.joined_round is round_one
        info = h.next_rendezvous()
        joined = h.joined_round
        assert h.node_id == "m0-r1" and joined is not None and joined.members == ("m0-r1",)
        assert info.rank == 0 and joined.round > round_one.round
    finally:
        h.release()
