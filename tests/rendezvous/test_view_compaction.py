"""The issue's scenario with real etcd: a node's rendezvous view (and `erm top`'s copy of the run) cut off
from etcd while 39 rounds are written, a node leaves, another arrives and etcd compacts its history; once
the node reaches etcd again, both show the newest round and members, not round 1."""

from __future__ import annotations

import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.rendezvous.view import JobView
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import AckRecord, NodeRecord, RoundRecord, dumps
from launcher.commands.top import WatchedRun
from tests.etcd.cutoff_proxy import CutoffProxy
from tests.etcd.test_compacted_watch import compact, wait_for


def node(name: str) -> bytes:
    return dumps(NodeRecord(node=name, host="h", addr="127.0.0.1", pid=1, nproc=1, state="active"))


def test_a_view_cut_off_while_etcd_compacts_reaches_the_newest_round(run_id, caplog) -> None:
    keys = Keyspace("/elastic-rm", run_id)
    with (
        EtcdCluster(size=1) as cluster,
        CutoffProxy(cluster.endpoint) as proxy,
        EtcdClient(cluster.endpoint, timeout=2) as writer,
        EtcdClient(proxy.endpoint, timeout=1) as cut_off,
    ):
        for n in ("n1", "n2"):
            writer.put(keys.node(n), node(n))
        writer.put(keys.leader, "n1")
        writer.put(keys.round, dumps(RoundRecord(round=1, members=("n1", "n2"), leader="n1", sealed=True)))
        writer.put(keys.ack(1, "n2"), dumps(AckRecord(node="n2")))
        view = JobView(cut_off, keys)
        view.start()
        view.track_members()
        top = WatchedRun(cut_off, keys)
        assert view.round is not None and view.round.round == 1 and set(view.nodes) == {"n1", "n2"}

        proxy.cut()
        writer.delete(keys.node("n2"))
        writer.put(keys.node("n3"), node("n3"))
        for number in range(2, 41):
            rec = RoundRecord(round=number, members=("n1", "n3"), leader="n1", sealed=True)
            writer.put(keys.round, dumps(rec))
        writer.put(keys.ack(40, "n3"), dumps(AckRecord(node="n3")))
        compacted = compact(writer)
        time.sleep(1.5)
        assert view.round.round == 1  # cut off: it cannot know yet

        with caplog.at_level("WARNING"):
            proxy.heal()
            wait_for(
                lambda: view.round is not None and view.round.round == 40, 20, "the view to reach round 40"
            )
            wait_for(lambda: set(view.nodes) == {"n1", "n3"}, 10, "the view's members")
            # each prefix (round, nodes, acks) is re-read by its own watch: the acks may come last
            wait_for(lambda: set(view.acks.get(40, {})) == {"n3"}, 10, "the view's acks of round 40")
            wait_for(lambda: top.revision >= compacted and not top.error, 10, "erm top's copy")
        assert view.round.members == ("n1", "n3") and view.round_rev >= compacted - 2
        assert view.leader == "n1" and view.error is None and view.watch_error is None
        assert set(view.acks.get(40, {})) == {"n3"} and "n2" not in view.acks.get(1, {})
        kvs, revision, error = top.snapshot()
        by_key = {kv.key: kv for kv in kvs}
        assert RoundRecord.parse(keys.round, by_key[keys.round].value).round == 40
        assert keys.node("n2") not in by_key and keys.node("n3") in by_key and not error
        assert "re-read at etcd revision" in caplog.text
        # and it follows on from there
        writer.put(keys.round, dumps(RoundRecord(round=41, members=("n1",), leader="n1", sealed=True)))
        wait_for(lambda: view.round.round == 41 and top.revision > revision, 10, "round 41")
        view.stop()
        top.close()


def test_a_resync_never_takes_the_view_back_behind_its_own_newer_round_write(etcd, run_id) -> None:
    """The leader applies its own round write at once (set_round, ahead of the watch). A resync read at
    an earlier revision must not replace it with the older round, nor delete it."""
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=2) as client:
        old_rev = client.put(keys.round, dumps(RoundRecord(round=5, members=("a",), sealed=True)))
        view = JobView(client, keys)
        view.start()
        try:
            newer = RoundRecord(round=6, members=("a", "b"))
            view.set_round(newer, old_rev + 10)
            old_kv = client.get(keys.round)
            view._on_resync(keys.round, True, [old_kv], old_rev + 1)  # what a resync read before the write
            assert view.round == newer and view.round_rev == old_rev + 10
            view._on_resync(keys.round, True, [], old_rev + 1)  # a read that does not hold the key yet
            assert view.round == newer
            view._on_resync(keys.round, True, [], old_rev + 20)  # read after it: the key is really gone
            assert view.round is None and view.round_rev == 0
        finally:
            view.stop()
