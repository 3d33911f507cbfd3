"""The elastic-rm RendezvousHandler with real etcd, several handlers per test (one per simulated node)."""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from dataclasses import replace

import pytest
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousGracefulExitError,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous import registry as torch_registry

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.errors import EtcdTimeoutError
from elastic_rm.etcd.lease import Election
from elastic_rm.planner.interface import NodeState
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.rendezvous.handler import ElasticRMRendezvousHandler
from elastic_rm.rendezvous.leader import adopt_straggler_flags
from elastic_rm.rendezvous.registration import create_handler
from elastic_rm.rendezvous.session import NodeIdInUse
from elastic_rm.wire.records import NodeRecord, dumps


def make(etcd, run_id, lo, hi, **conf) -> ElasticRMRendezvousHandler:
    conf = {"lease_ttl": "1", "last_call_timeout": "0.3", "join_timeout": "20", **conf}
    params = RendezvousParameters("elastic-rm", etcd.endpoint, run_id, lo, hi, local_addr="127.0.0.1", **conf)
    handler = create_handler(params)
    assert isinstance(handler, ElasticRMRendezvousHandler)
    return handler


def join_all(handlers, timeout=30.0):
    results, errors = {}, {}

    def run(i, h):
        try:
            results[i] = h.next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors[i] = exc

    threads = [threading.Thread(target=run, args=(i, h)) for i, h in enumerate(handlers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not errors, errors
    return results


def wait_for(predicate, timeout=15.0, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return False


@pytest.mark.parametrize("n", [2, 3, 4])
def test_nodes_form_a_round_with_distinct_ranks(etcd, run_id, n):
    handlers = [make(etcd, run_id, n, n) for _ in range(n)]
    try:
        infos = join_all(handlers)
        assert sorted(i.rank for i in infos.values()) == list(range(n))
        assert {i.world_size for i in infos.values()} == {n}
        masters = {
            (i.bootstrap_store_info.master_addr, i.bootstrap_store_info.master_port) for i in infos.values()
        }
        assert len(masters) == 1  # everyone bootstraps against rank 0
        # the agent store works across nodes: rank 0 writes, the others read
        by_rank = {i.rank: i for i in infos.values()}
        by_rank[0].store.set("probe", b"hello")
        assert all(by_rank[r].store.get("probe") == b"hello" for r in range(1, n))
        assert all(h.num_nodes_waiting() == 0 for h in handlers)
    finally:
        for h in handlers:
            h.shutdown()


def test_entry_point_registers_the_backend_in_torch(etcd, run_id):
    handler = torch_registry.get_rendezvous_handler(
        RendezvousParameters("elastic-rm", etcd.endpoint, run_id, 1, 1, lease_ttl="1")
    )
    try:
        assert handler.get_backend() == "elastic-rm" and handler.get_run_id() == run_id
    finally:
        handler.shutdown()


def test_lost_member_makes_survivors_rendezvous_again_and_a_joiner_scales_back_up(etcd, run_id):
    handlers = [make(etcd, run_id, 2, 3) for _ in range(3)]
    try:
        infos = join_all(handlers)
        assert {i.world_size for i in infos.values()} == {3}
        dead = handlers.pop(1)
        dead.release()  # the node vanishes: its lease is revoked (as when its lease expires)
        assert wait_for(lambda: all(h.num_nodes_waiting() > 0 for h in handlers))
        infos = join_all(handlers)
        assert sorted(i.rank for i in infos.values()) == [0, 1] and {
            i.world_size for i in infos.values()
        } == {2}
        late = make(etcd, run_id, 2, 3)
        handlers.append(late)
        t = threading.Thread(target=lambda: join_all([late]))
        t.start()
        assert wait_for(lambda: all(h.num_nodes_waiting() > 0 for h in handlers[:2]))
        infos = join_all(handlers[:2])
        t.join(20)
        assert {i.world_size for i in infos.values()} == {3}
    finally:
        for h in handlers:
            h.release()


def test_node_beyond_max_waits_as_standby_and_is_promoted(etcd, run_id):
    handlers = [make(etcd, run_id, 2, 2) for _ in range(2)]
    standby = None
    try:
        join_all(handlers)
        standby = make(etcd, run_id, 2, 2)
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("info", standby.next_rendezvous()))
        t.start()
        time.sleep(1.0)
        assert "info" not in box  # full: it waits
        assert all(h.num_nodes_waiting() == 0 for h in handlers)  # a standby arrival is no new round
        gone = handlers.pop(0)
        gone.release()
        infos = join_all(handlers)
        t.join(20)
        assert box["info"].world_size == 2 and infos[0].world_size == 2
        assert {box["info"].rank, infos[0].rank} == {0, 1}
    finally:
        for h in handlers + ([standby] if standby else []):
            h.release()


def test_leader_death_hands_over_and_rounds_go_on(etcd, run_id):
    handlers = [make(etcd, run_id, 1, 3) for _ in range(3)]
    try:
        join_all(handlers)
        leader = next(h for h in handlers if h.view.leader == h.node_id)
        handlers.remove(leader)
        leader.release()
        assert wait_for(lambda: handlers[0].view.leader in {h.node_id for h in handlers})
        infos = join_all(handlers)
        assert {i.world_size for i in infos.values()} == {2}
        assert handlers[0].view.round.leader in {h.node_id for h in handlers}
    finally:
        for h in handlers:
            h.release()


def test_a_round_records_the_planners_straggler_flags_and_a_new_leader_adopts_them(etcd, run_id, caplog):
    """A leader that takes over seeds its planner with the flags of the current round
    (rendezvous/leader.py): a straggler replaced before the handover is not taken back."""
    handlers = [make(etcd, run_id, 1, 3) for _ in range(2)]
    try:
        join_all(handlers)
        record = handlers[0].view.round
        assert record.extra["flagged"] == []  # written by every leader (none flagged here)
        leader = next(h for h in handlers if h.view.leader == h.node_id)._leader
        leader._policy = PlannerPolicy()
        adopt_straggler_flags(
            leader._policy, replace(record, extra={**record.extra, "flagged": ["node-b"]}), "x"
        )
        assert leader._policy.flagged == frozenset({"node-b"})
        with caplog.at_level(logging.WARNING, logger="elastic_rm.rendezvous.leader"):
            adopt_straggler_flags(
                leader._policy, replace(record, extra={**record.extra, "flagged": "node-c"}), "x"
            )
        assert leader._policy.flagged == frozenset({"node-b"})  # a malformed value changes nothing
        assert any("not a list of node ids; ignored" in r.getMessage() for r in caplog.records)
    finally:
        for h in handlers:
            h.release()


def test_a_campaign_that_won_though_its_answer_was_lost_leads_on_its_own_key(etcd, run_id, monkeypatch):
    """The campaign's transaction succeeded in etcd but its answer never came back (a timeout): the node
    sees its own key in the view and leads on it, fenced by that key's revision, without a second
    campaign (which would fail: the key exists) and without waiting for its own lease to expire."""
    real, calls = Election.try_acquire, []

    def answer_lost(self: Election) -> bool:
        calls.append(self.key)
        won = real(self)
        if len(calls) == 1:
            assert won
            self.revision = None
            raise EtcdTimeoutError("campaign: etcd did not answer within 5.0s")
        return won

    monkeypatch.setattr(Election, "try_acquire", answer_lost)
    h = make(etcd, run_id, 1, 1)
    try:
        info = join_all([h])[0]
        assert info.world_size == 1 and h.view.leader == h.node_id
        assert calls == [h.view.keys.leader]  # one campaign: the lost one
        with EtcdClient(etcd.endpoint, timeout=5) as c:
            key = c.get(h.view.keys.leader)
        assert key is not None and h._leader._election.revision == key.create_revision
        assert h.view.round.leader == h.node_id  # its fenced round write went through
    finally:
        h.release()


def test_restarted_workers_get_a_new_round_with_the_same_members(etcd, run_id):
    handlers = [make(etcd, run_id, 2, 2) for _ in range(2)]
    try:
        first = join_all(handlers)
        number = handlers[0].view.round.round
        box = {}
        t = threading.Thread(target=lambda: box.setdefault("info", handlers[0].next_rendezvous()))
        t.start()  # node 0's workers failed: it comes back
        assert wait_for(lambda: handlers[1].num_nodes_waiting() > 0)
        again = join_all(handlers[1:])
        t.join(20)
        assert handlers[1].view.round.round == number + 1
        assert box["info"].rank == first[0].rank and again[0].rank == first[1].rank
    finally:
        for h in handlers:
            h.release()


def test_closed_run_sends_waiting_nodes_home(etcd, run_id):
    a = make(etcd, run_id, 2, 2)
    try:
        box = {}

        def join():
            try:
                a.next_rendezvous()
            except Exception as exc:  # noqa: BLE001
                box["error"] = exc

        t = threading.Thread(target=join)
        t.start()
        closer = make(etcd, run_id, 2, 2)
        closer.set_closed()
        t.join(10)
        assert isinstance(box.get("error"), RendezvousGracefulExitError)
        assert a.is_closed() and closer.is_closed() and a.num_nodes_waiting() == 0
        closer.release()
    finally:
        a.release()


def test_malformed_round_value_names_the_key(etcd, run_id):
    with EtcdClient(etcd.endpoint) as c:
        c.put(f"/elastic-rm/{run_id}/round", b"{not json")
    h = make(etcd, run_id, 1, 1)
    try:
        with pytest.raises(RendezvousStateError, match=f"/elastic-rm/{run_id}/round"):
            h.next_rendezvous()
    finally:
        h.release()


@pytest.mark.parametrize(
    "lo,hi,run,conf,message",
    [
        (3, 2, "ok", {}, "greater than or equal to the minimum"),
        (1, 1, "a/b", {}, "invalid run id"),
        (1, 1, "ok", {"ssl_cert": "/nonexistent.pem", "ssl_cert_key": "/nonexistent.key"}, "does not exist"),
        (1, 1, "ok", {"lease_ttl": "-1"}, "lease_ttl"),
    ],
)
def test_bad_parameters_are_clear_errors(etcd, lo, hi, run, conf, message):
    with pytest.raises(ValueError, match=message):
        create_handler(RendezvousParameters("elastic-rm", etcd.endpoint, run, lo, hi, **conf))


def test_unreachable_endpoint_is_a_connection_error_naming_it():
    with pytest.raises(RendezvousConnectionError, match="127.0.0.1:9"):
        create_handler(RendezvousParameters("elastic-rm", "127.0.0.1:9", "r", 1, 1, etcd_timeout="1"))


def test_a_lease_that_expired_unnoticed_rejoins_as_a_new_member(etcd, run_id):
    """A starved process can miss its lease's expiry; its next registration then fails with 'lease not
    found'. That must not end the node: it rejoins under a new lease and a new id, as when the keeper
    notices first."""
    h = make(etcd, run_id, 1, 1, node_id="n0")
    try:
        h._session.lease.stop()  # the keeper is starved: it neither refreshes nor notices
        with EtcdClient(etcd.endpoint, timeout=2) as other:
            other.lease_revoke(h._session.lease.id)  # as etcd does when the TTL passes
        info = h.next_rendezvous()
        assert h.node_id == "n0-r1" and info.world_size == 1 and info.rank == 0
    finally:
        h.release()


def _hold_as(handler, pid: int) -> None:
    """Rewrite ``handler``'s node record, under its own lease, as if process ``pid`` of this host held it:
    once the record its join wrote as active without waiting has landed (a later landing would put the
    test process's own pid back)."""
    session = handler._session
    key = f"/elastic-rm/{handler.get_run_id()}/nodes/{session.node_id}"
    with EtcdClient(handler.settings.endpoints[0], timeout=2) as c:
        assert wait_for(lambda: NodeRecord.parse(key, c.get(key).value).state == NodeState.ACTIVE)
        c.put(key, dumps(replace(session.record(session.state), pid=pid)), lease=session.lease.id)


def test_a_second_process_under_a_live_processs_node_id_is_refused_and_the_first_keeps_its_round(
    etcd, run_id
):
    """Two live processes under one node id would take each other's rounds: the second one, on the same
    host as the live holder, is refused with an error naming it; the holder stays registered in its
    round under its own lease."""
    holder = subprocess.Popen(["sleep", "60"])  # the live process that holds the id
    first = make(etcd, run_id, 1, 2, node_id="x")
    second = None
    try:
        assert first.next_rendezvous().world_size == 1
        _hold_as(first, holder.pid)
        second = make(etcd, run_id, 1, 2, node_id="x")
        with pytest.raises(
            NodeIdInUse, match=rf"node id 'x' is in use in run {run_id}: pid {holder.pid} on "
        ):
            second.next_rendezvous()
        assert list(first.view.round.members) == ["x"] and first.view.round.round == 1
        with EtcdClient(etcd.endpoint, timeout=2) as c:
            kv = c.get(f"/elastic-rm/{run_id}/nodes/x")
            assert kv is not None and kv.lease == first._session.lease.id
    finally:
        first.release()
        if second is not None:
            second.release()
        holder.kill()
        holder.wait(10)


def test_a_node_id_whose_holder_died_is_taken_over_at_once(etcd, run_id):
    """An agent restarted on its node by a supervisor (the old process dead, its lease still alive): the
    new process takes the id over without waiting for the lease (docs/guarantees.md)."""
    gone = subprocess.Popen(["true"])
    gone.wait(10)  # a pid of this host that no process has any more
    old = make(etcd, run_id, 1, 1, node_id="x")
    old.next_rendezvous()
    old._session.lease.stop()  # killed: nothing refreshes its lease any more, nothing revokes it
    _hold_as(old, gone.pid)
    new = make(etcd, run_id, 1, 1, node_id="x", lease_ttl="30")
    try:
        info = new.next_rendezvous()
        assert new.node_id == "x" and info.world_size == 1
    finally:
        new.release()


def test_a_joined_node_registers_as_active_and_logs_its_round_in_one_etcd_request(etcd, run_id):
    """1,000 nodes make these two writes at once while etcd still sends the round to the rest: one
    transaction each (one revision), not two puts."""
    hs = [make(etcd, run_id, 2, 2, node_id=f"n{i}") for i in range(2)]
    try:
        join_all(hs)
        keys = hs[0].settings.keys
        with EtcdClient(etcd.endpoint, timeout=2) as c:
            for _ in range(100):
                records = [c.get(keys.node(f"n{i}")) for i in range(2)]
                events = [kv for kv in c.get_prefix(keys.events)[0] if b'"message":"joined round' in kv.value]
                if all(b'"state":"active"' in r.value for r in records) and len(events) >= 2:
                    break
                time.sleep(0.05)
        for i, record in enumerate(records):
            assert b'"state":"active"' in record.value
            mine = [kv for kv in events if f"-n{i}-".encode() in kv.key.encode()]
            assert [kv.mod_revision for kv in mine] == [record.mod_revision]
    finally:
        for h in hs:
            h.release()


def test_the_first_round_is_decided_as_soon_as_max_nodes_are_there(etcd, run_id, monkeypatch):
    """The leader paces its decisions to batch a burst of arrivals; once MAX nodes are there no arrival can
    change the first round, so it is written at once, not after the pause (here made endless)."""
    from elastic_rm.rendezvous import leader

    monkeypatch.setattr(leader, "DECIDE_PACE", 1e6)
    monkeypatch.setattr(leader, "DECIDE_PAUSE_MAX_S", 1e6)
    hs = [make(etcd, run_id, 1, 3, node_id=f"n{i}", last_call_timeout="60") for i in range(3)]
    try:
        join_all(hs, timeout=20)
        assert {h.joined_round.world_size for h in hs} == {3}
    finally:
        for h in hs:
            h.release()


def test_a_scale_up_round_keeps_everyone_without_listing_the_kept_members_again(etcd, run_id):
    """``extra.alive`` lists only old members that the new round leaves out: the kept ones are members
    already, and at 1,000 nodes a second copy of the member list doubles what every node receives."""
    hs = [make(etcd, run_id, 2, 3, node_id=f"n{i}") for i in range(2)]
    try:
        join_all(hs)
        hs.append(make(etcd, run_id, 2, 3, node_id="n2"))
        joiner = threading.Thread(
            target=lambda: pytest.raises(RendezvousClosedError, hs[2].next_rendezvous), daemon=True
        )
        joiner.start()  # it waits for n0 and n1 to ack; released below
        for _ in range(200):
            r = hs[0].view.round
            if r is not None and r.round == 2:
                break
            time.sleep(0.05)
        assert set(r.members) == {"n0", "n1", "n2"} and r.extra["alive"] == []
        assert hs[0].services.peers_all_kept() and hs[1].services.peers_all_kept()
    finally:
        for h in hs:
            h.release()


def test_drain_is_possible_when_the_old_members_are_alive_even_if_left_out(etcd, run_id):
    """A planned round that leaves a live member out (a straggler swap, a scale-down) can drain: every old
    member reaches a step boundary. A round after a loss cannot: a collective with the dead never returns.
    Live: a planned round written to etcd reaches both handlers' views. The rule itself is checked on
    records (peers_kept): a second write to the live round key would race the leader's own next round."""
    from elastic_rm.rendezvous.node_services import peers_kept
    from elastic_rm.wire.records import RoundRecord

    hs = [make(etcd, run_id, 2, 2, node_id=f"n{i}") for i in range(2)]
    try:
        join_all(hs)
        keys = hs[0].settings.keys
        wait = lambda pred: [time.sleep(0.05) for _ in range(100) if not pred()]  # noqa: E731
        with EtcdClient(etcd.endpoint, timeout=2) as c:
            planned = RoundRecord(round=2, members=("n0",), reason="planned", extra={"alive": ["n0", "n1"]})
            c.put(keys.round, planned.to_json())
            wait(lambda: all(h.view.round.round == 2 for h in hs))  # each view by its own watch
            assert hs[0].services.peers_all_kept() and hs[1].services.peers_all_kept()
    finally:
        for h in hs:
            h.release()
    done = RoundRecord(round=1, members=("n0", "n1"))
    lost = RoundRecord(round=2, members=("n0",), reason="1 member(s) lost", extra={"alive": ["n0"]})
    assert peers_kept(planned, done) and not peers_kept(lost, done)
    assert peers_kept(RoundRecord(round=2, members=("n0", "n1", "n2")), done)  # a scale-up keeps everyone
    assert not peers_kept(RoundRecord(round=3, members=("n0",), extra={"alive": ["n0", "n1"]}), done)
    assert not peers_kept(done, done) and not peers_kept(None, done) and not peers_kept(planned, None)
    junk = RoundRecord(round=2, members=("n0",), extra={"alive": "n1"})  # not a list: nobody counted alive
    assert not peers_kept(junk, done)


def test_a_store_wait_ends_when_its_round_is_superseded(etcd, run_id):
    """torch's rank exchange waits in the round's store for every member; with a member dead right after
    the seal it would wait until the timeout. A newer round ends the wait at once, with its own error."""
    from elastic_rm.rendezvous.etcd_store import EtcdStore, RoundSupersededError

    newer = threading.Event()
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        store = EtcdStore(c, f"/{run_id}/store/1/", timeout=60, superseded=newer.is_set)
        store.set("a", b"1")
        assert store.get("a") == b"1"  # present keys never ask
        threading.Timer(0.3, newer.set).start()
        with pytest.raises(RoundSupersededError, match="join the newer round"):  # not the timeout's error
            store.get("dead-member")


def test_a_store_wait_ends_when_the_run_is_closed(etcd, run_id):
    """torch's exit barrier waits in the round's store for every member; a member whose workers failed
    after the others finished never arrives, and closes the run as it exits: that ends the wait at once."""
    from elastic_rm.rendezvous.etcd_store import EtcdStore, RunClosedError

    closed_by: list[str] = []
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        store = EtcdStore(
            c, f"/{run_id}/store/1/", timeout=60, closed=lambda: closed_by[0] if closed_by else None
        )
        store.set("a", b"1")
        closed_by.append("b")
        assert store.get("a") == b"1"  # present keys never ask
        assert store.peek("a") == b"1" and store.peek("absent") is None
        with pytest.raises(RunClosedError, match=r"closed \(by b\)"):  # not the timeout's error
            store.get("torchelastic/agent/terminal_state/last_member")
