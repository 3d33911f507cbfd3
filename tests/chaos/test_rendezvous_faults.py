"""Rendezvous-level faults with real etcd and several handlers (one per simulated node), fast enough for
the default suite. The end-to-end versions with ermrun processes are in test_round_faults.py (slow)."""

from __future__ import annotations

import threading

from tests.chaos.helpers import check_round_history, round_history
from tests.rendezvous.test_handler import join_all, make, wait_for


def _die_without_revoking(h) -> None:
    """What SIGKILL leaves behind: the lease is neither refreshed nor revoked; it lives out its TTL."""
    h._shut = True
    h._session.lease.stop()
    h._leader.stop()
    h._view.stop()
    h._client.close()


def test_a_process_restarted_under_the_same_node_id_does_not_join_the_stale_round(etcd, run_id):
    """Node b dies and a new process with the same node id starts at once, while b's lease still lives
    (lease TTL 5 s). The round sealed before the new process registered is one the peers' workers already
    ran; joining it would hang the new workers and leave the peers waiting for a round that never comes.
    The new process must instead get (and its peer with it) a new round with the same members."""
    a, b = (
        make(etcd, run_id, 2, 2, node_id="a", lease_ttl="5"),
        make(etcd, run_id, 2, 2, node_id="b", lease_ttl="5"),
    )
    handlers = [a]
    try:
        first = join_all([a, b])
        number = a.view.round.round
        _die_without_revoking(b)
        b2 = make(etcd, run_id, 2, 2, node_id="b", lease_ttl="5")
        handlers.append(b2)
        box: dict = {}
        t = threading.Thread(target=lambda: box.setdefault("info", b2.next_rendezvous()), daemon=True)
        t.start()
        assert wait_for(lambda: a.num_nodes_waiting() > 0, timeout=20), "no new round for the restarted node"
        again = join_all([a])  # a's workers restart into the new round
        t.join(30)
        assert "info" in box, "the restarted node never completed a round"
        assert b2.joined_round.round == a.joined_round.round == number + 1
        assert sorted(b2.joined_round.members) == ["a", "b"]
        assert b2.joined_round.members == a.joined_round.members  # they agree
        assert box["info"].world_size == again[0].world_size == 2
        assert box["info"].rank + again[0].rank == 1 and first[0].world_size == 2
        check_round_history(round_history(a._client, run_id))
    finally:
        for h in handlers:
            h.release()


def test_an_ack_lost_by_etcd_is_sent_again_and_the_round_is_sealed(etcd, run_id):
    """An ack is sent without waiting for etcd's answer (the join path); during an etcd failover such a put
    can be lost (seen with a 3-member cluster whose leader was killed). Simulated here by deleting the ack:
    the member sends it again while the round stays unsealed, and the round is sealed. The round is a
    scale-up (a newcomer next to active members), one of the rounds whose members ack before the seal (a
    round of survivors is sealed at once: rendezvous/seal.py)."""
    a, b, c = (make(etcd, run_id, 2, 3, node_id=n, lease_ttl="5") for n in "abc")
    try:
        join_all([a, b])
        number = a.view.round.round
        box: dict = {}
        newcomer = threading.Thread(target=lambda: box.setdefault("c", c.next_rendezvous()), daemon=True)
        newcomer.start()
        assert wait_for(lambda: a.num_nodes_waiting() > 0, timeout=20), "the scale-up round never came"
        t = threading.Thread(target=lambda: box.setdefault("a", a.next_rendezvous()), daemon=True)
        t.start()  # a stops its workers for the new round and acks it
        ack_key = f"/elastic-rm/{run_id}/rounds/{number + 1:08d}/acks/a"
        assert wait_for(lambda: a._client.get(ack_key) is not None, timeout=20), "a never acked"
        assert a.view.round is not None and not a.view.round.sealed  # b has not acked yet
        assert a._client.delete(ack_key)  # the ack is lost
        done = join_all([b], timeout=30)
        t.join(30)
        newcomer.join(30)
        assert 0 in done and "a" in box and "c" in box, "the round was never sealed after a lost ack"
        assert a.joined_round.round == b.joined_round.round == c.joined_round.round == number + 1
        assert sorted(a.joined_round.members) == ["a", "b", "c"]
    finally:
        for h in (a, b, c):
            h.release()
