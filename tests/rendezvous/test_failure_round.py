"""The survivors' round after a member's loss: written sealed at once, joined without a re-registration.

Why: at 1,024 nodes the survivors' re-join (a registration as joining and an ack each, then the seal)
took longer than the lease TTL (docs/benchmarks.md, "benchmarks/scale"). The rule itself (seal.py) is
tested without etcd below; the handlers' part with a real etcd.
"""

from __future__ import annotations

import json

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.planner.interface import NodeState
from elastic_rm.rendezvous.seal import sealed_at_once
from elastic_rm.wire.records import NodeRecord, RoundRecord

from .test_handler import join_all, make, wait_for


def node(name: str, state: NodeState, round_: int, port: int = 4000) -> NodeRecord:
    return NodeRecord(name, "h", f"10.0.0.{len(name)}", 1, 1, state, round=round_, master_port=port)


CURRENT = RoundRecord(7, ("a", "b", "c"), sealed=True, master=("10.0.0.1", 3999))


def test_a_round_of_active_survivors_is_sealed_with_rank_0s_advertised_port():
    record = RoundRecord(8, ("b", "c"))
    out = sealed_at_once(
        record, [node("b", NodeState.ACTIVE, 7, 4100), node("c", NodeState.JOINING, 7)], CURRENT
    )
    assert out.sealed and out.master == ("10.0.0.1", 4100)


def test_rounds_that_need_acks_stay_unsealed():
    survivors = RoundRecord(8, ("b", "c"))
    cases = [
        # an active member that has not yet registered for the current round
        (survivors, [node("b", NodeState.ACTIVE, 7), node("c", NodeState.ACTIVE, 6)], CURRENT),
        # a member without a live registration
        (survivors, [node("b", NodeState.ACTIVE, 7), None], CURRENT),
        # rank 0 advertises no port
        (survivors, [node("b", NodeState.ACTIVE, 7, 0), node("c", NodeState.ACTIVE, 7)], CURRENT),
        # a newcomer next to active members: not a round of survivors
        (
            RoundRecord(8, ("b", "d")),
            [node("b", NodeState.ACTIVE, 7), node("d", NodeState.JOINING, 0)],
            CURRENT,
        ),
        # the current round was never sealed: its members never ran it
        (
            survivors,
            [node("b", NodeState.ACTIVE, 7), node("c", NodeState.ACTIVE, 7)],
            RoundRecord(7, ("a", "b", "c")),
        ),
        # a member of the current round whose record is still the one it waited for that round with (its
        # update to active not yet in etcd), next to a newcomer: its advertised port may be in use now
        (
            RoundRecord(8, ("a", "b", "d")),
            [
                node("a", NodeState.JOINING, 0),
                node("b", NodeState.JOINING, 0),
                node("d", NodeState.JOINING, 0),
            ],
            CURRENT,
        ),
    ]
    for record, members, current in cases:
        assert not sealed_at_once(record, members, current).sealed, (record, members)
    # every member already waiting: sealed, whatever the current round (the first round, a newcomer)
    waiting = [node("b", NodeState.JOINING, 7), node("d", NodeState.STANDBY, 0)]
    assert sealed_at_once(RoundRecord(8, ("b", "d")), waiting, None).sealed


def test_survivors_of_a_loss_join_a_round_sealed_at_once_without_registering_again(etcd, run_id):
    handlers = [make(etcd, run_id, 2, 3) for _ in range(3)]
    keys = handlers[0].settings.keys
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        try:
            first = join_all(handlers)
            assert {i.world_size for i in first.values()} == {3}

            def active() -> bool:
                kvs, _ = client.get_prefix(keys.nodes)
                records = [json.loads(kv.value) for kv in kvs]
                return len(records) == 3 and all(r["state"] == "active" and r["round"] == 1 for r in records)

            assert wait_for(active)  # each node registered as active in round 1 (sent without waiting)
            writes: list[tuple[str, dict]] = []
            start = client.ping() + 1
            cancel = client.watch_prefix(
                keys.run,
                start,
                lambda evs: writes.extend(
                    (e.kv.key, json.loads(e.kv.value))
                    for e in evs
                    if e.kind == "put" and "/events/" not in e.kv.key
                ),
            )
            dead = handlers.pop(1)
            dead.release()  # the node vanishes: its lease is revoked (as when its lease expires)
            assert wait_for(lambda: all(h.num_nodes_waiting() > 0 for h in handlers))
            infos = join_all(handlers)
            assert sorted(i.rank for i in infos.values()) == [0, 1]
            assert {i.world_size for i in infos.values()} == {2}
            masters = {
                (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port)
                for i in infos.values()
            }
            assert len(masters) == 1 and next(iter(masters))[1] > 0
            assert wait_for(lambda: sum(1 for k, v in writes if k.startswith(keys.nodes)) >= 2)
            cancel()
            rounds = [v for k, v in writes if k == keys.round]
            assert [(r["round"], r["sealed"]) for r in rounds] == [(2, True)], rounds  # no unsealed write
            assert not [k for k, _ in writes if "/acks/" in k], "a survivor acked a round sealed at once"
            states = [v["state"] for k, v in writes if k.startswith(keys.nodes)]
            assert states and set(states) == {"active"}, states  # nobody registered as joining again
            # the round's store works between the survivors
            by_rank = {i.rank: i for i in infos.values()}
            by_rank[0].store.set("probe", b"after the loss")
            assert by_rank[1].store.get("probe") == b"after the loss"
        finally:
            for h in handlers:
                h.release()
