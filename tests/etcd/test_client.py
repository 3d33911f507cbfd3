"""The etcd facade against a real etcd: revisions, CAS, leases, watches, failover, clear errors."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from aetcd import rpc

from elastic_rm.etcd.client import Compare, EtcdClient, Op, TlsOptions, WatchEvent, parse_endpoints
from elastic_rm.etcd.endpoint_probe import has_leader
from elastic_rm.etcd.errors import EtcdConfigError, EtcdConnectionError, EtcdError
from elastic_rm.etcd.lease import Election, KeptLease
from elastic_rm.etcd.server import EtcdCluster, EtcdServerError, find_etcd_binary


def test_put_get_prefix_and_revisions(etcd, run_id):
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        rev = c.put(f"/{run_id}/a", b"1")
        c.put(f"/{run_id}/b", "2")
        kv = c.get(f"/{run_id}/a")
        assert kv is not None and kv.value == b"1" and kv.mod_revision == rev == kv.create_revision
        kvs, read_rev = c.get_prefix(f"/{run_id}/")
        assert [k.key for k in kvs] == [f"/{run_id}/a", f"/{run_id}/b"] and read_rev >= rev + 1
        assert c.get(f"/{run_id}/missing") is None
        assert c.delete(f"/{run_id}/", prefix=True)
        assert c.get_prefix(f"/{run_id}/")[0] == []


def test_txn_compares_mod_revision(etcd, run_id):
    key = f"/{run_id}/cas"
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        first = c.txn([Compare.absent(key)], [Op.put(key, "a")])
        assert first.succeeded
        again = c.txn([Compare.absent(key)], [Op.put(key, "b")], [Op.get(key)])
        assert not again.succeeded and again.kvs[0].value == b"a"
        ok = c.txn([Compare.mod(key, first.revision)], [Op.put(key, "c")])
        stale = c.txn([Compare.mod(key, first.revision)], [Op.put(key, "d")])
        assert ok.succeeded and not stale.succeeded
        assert c.get(key).value == b"c"


def test_lease_keeps_key_alive_then_expires_after_revoke_or_stop(etcd, run_id):
    key = f"/{run_id}/leased"
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        lease = KeptLease(c, ttl=1)
        c.put(key, "x", lease=lease.id)
        time.sleep(2.5)  # > 2 TTLs: alive only because it is refreshed
        assert c.get(key) is not None and not lease.lost
        lease.stop()
        deadline = time.monotonic() + 5
        while c.get(key) is not None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.get(key) is None
        assert not lease.check() and lease.lost


def test_watch_delivers_in_order_and_resumes_after_etcd_restart(run_id):
    with EtcdCluster(size=1) as cluster, EtcdClient(cluster.endpoint, timeout=1) as c:
        seen: list[WatchEvent] = []
        got = threading.Event()

        def on_events(events):
            seen.extend(events)
            got.set()

        start = c.put("/w/start", "0")
        cancel = c.watch_prefix("/w/", start + 1, on_events)
        c.put("/w/a", "1")
        c.delete("/w/a")
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(e.kind, e.kv.key) for e in seen] == [("put", "/w/a"), ("delete", "/w/a")]
        cluster.restart(0)
        # written right after the restart: the watch must replay it from its last revision
        for _ in range(50):
            try:
                c.put("/w/b", "2")
                break
            except EtcdConnectionError:
                time.sleep(0.1)
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        cancel()
        assert [(e.kind, e.kv.key) for e in seen][2:] == [("put", "/w/b")]


def test_failover_when_a_cluster_member_dies():
    with EtcdCluster(size=3) as cluster, EtcdClient(cluster.endpoints, timeout=1) as c:
        c.put("/f/k", "v")
        cluster.kill(0)
        assert c.get("/f/k").value == b"v"
        c.put("/f/k", "w")
        assert c.get("/f/k").value == b"w"


def _is_leader(endpoint: str) -> bool:
    """Whether the member at ``endpoint`` is the raft leader (its own id is the leader's)."""

    async def status(a):
        await a.connect()
        return await a.maintenancestub.Status(rpc.StatusRequest(), timeout=3)

    with EtcdClient(endpoint, timeout=3) as c:
        reply = c.run(status)
    return reply.header.member_id == reply.leader


def test_failover_goes_straight_to_an_endpoint_with_a_leader_past_a_dead_one(caplog):
    """All other endpoints are asked at once (endpoint_probe.py): from a dead first endpoint the client
    moves to the live member, not to the dead member listed before it (the list order did that)."""
    with EtcdCluster(size=3) as cluster:
        # kill a follower: a member keeps naming a dead leader until its election timeout, and a put there
        # then times out (the client moves on at its next failover, but this test is about the first one)
        followers = [i for i, e in enumerate(cluster.endpoints) if not _is_leader(e)]
        dead, live = followers[0], next(i for i in range(3) if i != followers[0])
        cluster.kill(dead)
        states = cluster.post_mortem().splitlines()[:3]  # what a test prints when its etcd went away
        assert [("exited with -9" in line, "running" in line) for line in states] == [
            (i == dead, i != dead) for i in range(3)
        ], states
        with caplog.at_level(logging.WARNING, logger="elastic_rm.etcd.connection"):
            endpoints = ["127.0.0.1:1", cluster.endpoints[dead], cluster.endpoints[live]]
            live = cluster.endpoints[live]
            with EtcdClient(endpoints, timeout=1) as c:
                assert c.put("/f/probe", "v") > 0
                assert c.endpoint == live and c.get("/f/probe").value == b"v"
        switches = [r.getMessage() for r in caplog.records if "switching to endpoint" in r.getMessage()]
        assert switches == [f"etcd: switching to endpoint {live}"], switches


def test_failover_prefers_a_member_that_answers_without_a_leader_to_one_that_does_not_answer(caplog):
    """In an election no member has a leader; a member cut off by a partition does not answer at all.
    Here the last member of three is left alone (no quorum: it answers Status with no leader) and the
    endpoint listed before it is dead: the failover goes to the member that answered."""
    with EtcdCluster(size=3) as cluster:
        alone = cluster.endpoints[2]
        cluster.kill(0)
        cluster.kill(1)
        with EtcdClient(alone, timeout=1) as probe:
            deadline = time.monotonic() + 20
            while probe.run(lambda a: has_leader(a, 1.0)) and time.monotonic() < deadline:
                time.sleep(0.1)  # until it has noticed that its leader (or its followers) are gone
            assert not probe.run(lambda a: has_leader(a, 1.0))
        with caplog.at_level(logging.WARNING, logger="elastic_rm.etcd.connection"):
            with pytest.raises(EtcdError), EtcdClient(["127.0.0.1:1", "127.0.0.1:9", alone], timeout=1) as c:
                c.put("/f/alone", "v")  # no quorum anywhere: it fails, after trying each endpoint once
        switches = [r.getMessage() for r in caplog.records if "switching to endpoint" in r.getMessage()]
        assert switches[0] == f"etcd: switching to endpoint {alone}", switches  # not 127.0.0.1:9 first


def test_failover_without_any_endpoint_that_has_a_leader_keeps_the_list_order_and_names_them_all():
    with pytest.raises(EtcdConnectionError, match="tried 127.0.0.1:1, 127.0.0.1:9") as failed:
        EtcdClient(["127.0.0.1:1", "127.0.0.1:9"], timeout=1).ping()
    assert "Check that etcd runs there" in str(failed.value)


def test_election_fences_a_deposed_leader(etcd, run_id):
    key = f"/{run_id}/leader"
    with EtcdClient(etcd.endpoint, timeout=2) as c:
        l1, l2 = KeptLease(c, 5), KeptLease(c, 5)
        first, second = Election(c, key, "n1", l1.id), Election(c, key, "n2", l2.id)
        assert first.try_acquire() and not second.try_acquire()
        l1.revoke()  # n1 loses its lease: its key goes, n2 can lead
        assert second.try_acquire()
        stale = c.txn([first.fence()], [Op.put(f"/{run_id}/round", "from-n1")])
        fresh = c.txn([second.fence()], [Op.put(f"/{run_id}/round", "from-n2")])
        assert not stale.succeeded and fresh.succeeded
        l2.revoke()


def test_unreachable_endpoint_is_an_error_naming_it_and_what_to_check():
    with pytest.raises(EtcdConnectionError, match="127.0.0.1:9 is unreachable.*Check that etcd runs there"):
        EtcdClient("127.0.0.1:9", timeout=1).ping()


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"tls": TlsOptions(cert="/nonexistent/cert.pem", key="/nonexistent/key.pem")}, "does not exist"),
        ({"tls": TlsOptions(cert="/etc/hostname")}, "both a client certificate and its key"),
        ({"user": "root"}, "both a user and a password"),
        ({"timeout": 0}, "must be > 0"),
    ],
)
def test_bad_client_options_are_clear_errors(kwargs, message):
    with pytest.raises(EtcdConfigError, match=message):
        EtcdClient("127.0.0.1:2379", **kwargs)


def test_parse_endpoints():
    assert parse_endpoints("a:1, http://b:2/,c") == [("a", 1), ("b", 2), ("c", 2379)]
    with pytest.raises(EtcdConfigError, match="malformed etcd endpoint"):
        parse_endpoints("host:notaport")


def test_binary_lookup_order(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_RM_ETCD_BINARY", str(tmp_path / "missing-etcd"))
    with pytest.raises(EtcdServerError, match="ELASTIC_RM_ETCD_BINARY"):
        find_etcd_binary()
    monkeypatch.delenv("ELASTIC_RM_ETCD_BINARY")
    assert find_etcd_binary().endswith("etcd")


def test_get_prefix_reads_in_pages_at_one_revision(etcd, run_id):
    """A prefix larger than one page (and than gRPC's default 4 MiB answer) comes back whole, in key order,
    at the revision of its first page."""
    with EtcdClient(etcd.endpoint, timeout=10) as c:
        value = b"x" * 100_000
        for i in range(45):  # 4.5 MB in all
            c.put(f"/{run_id}/big/{i:03d}", value)
        kvs, rev = c.get_prefix(f"/{run_id}/big/", page=7)
        assert [kv.key for kv in kvs] == [f"/{run_id}/big/{i:03d}" for i in range(45)]
        assert all(kv.value == value for kv in kvs) and rev >= max(kv.mod_revision for kv in kvs)
        assert len(c.get_prefix(f"/{run_id}/big/")[0]) == 45
        c.delete(f"/{run_id}/big/", prefix=True)


def test_get_many_reads_the_keys_that_exist_at_once(etcd):
    """Plain concurrent ranges, not one read-only txn (etcd before 3.5.5 panics when one is cancelled)."""
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        for i in range(5):
            c.put(f"/gm/{i}", f"v{i}")
        got = c.get_many([f"/gm/{i}" for i in (3, 0, 7, 4)])
        assert [(kv.key, kv.value) for kv in got] == [("/gm/3", b"v3"), ("/gm/0", b"v0"), ("/gm/4", b"v4")]
        assert c.get_many([]) == []
