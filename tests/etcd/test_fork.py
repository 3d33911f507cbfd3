"""The etcd facade across fork(), with real processes and a real etcd.

gRPC's asyncio layer does not survive fork() while a channel is open, so a process forked then talks to
etcd's JSON gateway (elastic_rm/etcd/gateway.py). These tests pin: a child forked while its parent holds
a client (with a watch and a kept lease running) does every facade operation; a child forked after the
parent closed its clients still uses gRPC; an inherited client refuses with a clear message; a rendezvous
across forked children completes while the parent holds a client; spawned children work at any time.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rm.etcd.client import Compare, EtcdClient, Op
from elastic_rm.etcd.errors import EtcdCompactedError, EtcdConnectionError
from elastic_rm.etcd.lease import KeptLease
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.rendezvous.registration import create_handler


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _report(queue, work, *args) -> None:
    """Runs ``work(*args)`` in the child; the parent gets ("ok", result) or ("error", type, message)."""
    try:
        queue.put(("ok", work(*args)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as data
        queue.put(("error", type(exc).__name__, str(exc)))


def _run(ctx_name: str, work, *args) -> tuple:
    ctx = mp.get_context(ctx_name)
    queue = ctx.Queue()
    proc = ctx.Process(target=_report, args=(queue, work, *args))
    proc.start()
    proc.join(90)
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"
    return queue.get(timeout=5)


def _put_and_watch(endpoint: str, key: str) -> str:
    with EtcdClient(endpoint, timeout=3) as client:
        client.put(key, str(os.getpid()))
        seen = []
        cancel = client.watch_prefix(key, 1, seen.extend, exact=True)
        assert wait_for(lambda: len(seen) == 1)
        cancel()
        return client.transport


def _every_operation(endpoint: str, prefix: str) -> dict:
    """Each facade operation once, in a child forked while its parent held an open client."""
    out: dict = {}
    with EtcdClient(endpoint, timeout=3) as c:
        out["transport"] = c.transport
        out["ping"] = c.ping() > 0
        first = c.put(f"{prefix}/a", "1")
        c.put(f"{prefix}/b", b"\x00\xffbinary")
        c.put_nowait(f"{prefix}/c", "nowait")
        assert wait_for(lambda: c.get(f"{prefix}/c") is not None)
        kv = c.get(f"{prefix}/a")
        out["get"] = (kv.value, kv.create_revision == first, kv.version)
        out["missing"] = c.get(f"{prefix}/nothing")
        kvs, revision = c.get_prefix(f"{prefix}/", page=2)  # two pages at one revision
        out["prefix"] = [(k.key, k.value) for k in kvs]
        out["prefix_revision"] = revision >= kvs[-1].mod_revision
        ok = c.txn(
            [Compare.mod(f"{prefix}/a", first), Compare.absent(f"{prefix}/new")],
            [Op.put(f"{prefix}/new", "n"), Op.get(f"{prefix}/a")],
            [Op.get(f"{prefix}/b")],
        )
        stale = c.txn(
            [Compare.mod(f"{prefix}/a", first - 1)],
            [Op.delete(f"{prefix}/a")],
            [Op.get(f"{prefix}/b"), Op.delete_range(f"{prefix}/a", f"{prefix}/b")],
        )
        value_txn = c.txn([Compare.value_is(f"{prefix}/new", "n")], [Op.delete(f"{prefix}/x/", prefix=True)])
        out["txn"] = (ok.succeeded, [k.value for k in ok.kvs], stale.succeeded, [k.value for k in stale.kvs])
        out["txn_value"] = value_txn.succeeded
        out["deleted_by_range"] = c.get(f"{prefix}/a") is None
        out["delete"] = (c.delete(f"{prefix}/new"), c.delete(f"{prefix}/new"))

        events, resyncs = [], []
        start = c.put(f"{prefix}/w/0", "0")
        cancel = c.watch_prefix(f"{prefix}/w/", start, events.extend)
        c.put(f"{prefix}/w/1", "1")
        c.delete(f"{prefix}/w/0")
        assert wait_for(lambda: len(events) == 3), events
        out["watch"] = [(e.kind, e.kv.key, e.kv.value) for e in events]
        cancel()
        errors: list = []
        compacted_at = c.put(f"{prefix}/w/2", "2")
        c.run(lambda a: a.compact(compacted_at, physical=True))
        cancel = c.watch_prefix(
            f"{prefix}/w/",
            start,
            lambda evs: None,
            errors.append,
            on_resync=lambda kvs, rev: resyncs.append(([k.key for k in kvs], rev)),
        )
        assert wait_for(lambda: resyncs), "no resync after a compaction"
        cancel()
        out["resync"] = resyncs[0][0]
        cancel = c.watch_prefix(f"{prefix}/w/", start, lambda evs: None, errors.append)
        assert wait_for(lambda: errors), "no compaction error without on_resync"
        cancel()
        out["compacted_error"] = isinstance(errors[0], EtcdCompactedError)

        lease_id, ttl = c.lease_grant(1)
        out["lease"] = (ttl >= 1, c.lease_refresh(lease_id) >= 1)
        c.lease_revoke(lease_id)
        out["refresh_revoked"] = c.lease_refresh(lease_id)
        c.lease_revoke(lease_id)  # a second revoke is no error
        lost: list = []
        kept = KeptLease(c, 1, on_lost=lambda: lost.append(True))
        c.put(f"{prefix}/leased", "x", lease=kept.id)
        time.sleep(3.5)  # three and a half TTLs: the keep-alive must refresh it
        out["kept"] = (c.get(f"{prefix}/leased") is not None, kept.max_gap < 1.0, lost)
        kept.revoke()
        out["revoked_key_gone"] = c.get(f"{prefix}/leased") is None
    with EtcdClient(f"127.0.0.1:1,{endpoint}", timeout=1) as failing_over:  # the first endpoint is dead
        out["failover"] = (failing_over.put(f"{prefix}/failover", "f") > 0, failing_over.endpoint == endpoint)
    try:
        EtcdClient("127.0.0.1:1", timeout=1).ping()
    except EtcdConnectionError as exc:
        out["unreachable"] = str(exc)
    return out


def test_child_forked_while_a_client_is_open_does_every_operation_over_the_gateway(etcd, run_id):
    prefix = f"/{run_id}"
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        parent.put(f"{prefix}/parent", "x")
        seen = []
        cancel = parent.watch_prefix(f"{prefix}/", 1, seen.extend)  # gRPC busy in the parent: a watch
        kept = KeptLease(parent, 2)  # and a keep-alive stream
        got = _run("fork", _every_operation, etcd.endpoint, f"{prefix}/child")
        assert got[0] == "ok", got
        out = got[1]
        assert out["transport"] == "gateway" and out["ping"]
        assert out["get"] == (b"1", True, 1) and out["missing"] is None
        assert out["prefix"] == [
            (f"{prefix}/child/{k}", v) for k, v in (("a", b"1"), ("b", b"\x00\xffbinary"), ("c", b"nowait"))
        ]
        assert out["prefix_revision"]
        assert out["txn"] == (True, [b"1"], False, [b"\x00\xffbinary"]) and out["txn_value"]
        assert out["deleted_by_range"] and out["delete"] == (True, False)
        assert out["watch"] == [
            ("put", f"{prefix}/child/w/0", b"0"),
            ("put", f"{prefix}/child/w/1", b"1"),
            ("delete", f"{prefix}/child/w/0", b""),
        ]
        assert out["resync"] == [f"{prefix}/child/w/1", f"{prefix}/child/w/2"]
        assert out["compacted_error"]
        assert out["lease"] == (True, True) and out["refresh_revoked"] <= 0
        assert out["kept"] == (True, True, []) and out["revoked_key_gone"]
        assert "127.0.0.1:1" in out["unreachable"] and out["failover"] == (True, True)
        # the parent's client, watch and lease are unharmed by the child
        parent.put(f"{prefix}/after", "y")
        assert wait_for(lambda: any(e.kv.key == f"{prefix}/after" for e in seen))
        assert parent.get(f"{prefix}/child/b").value == b"\x00\xffbinary"
        assert not kept.lost and parent.lease_refresh(kept.id) > 0
        kept.revoke()
        cancel()


class _Finalized:
    """Garbage in a reference cycle whose finalizer leaves a mark: ``<dir>/<pid of the finalizing
    process>``."""

    def __init__(self, marks: str):
        self.marks = marks
        self.cycle = self

    def __del__(self) -> None:
        open(os.path.join(self.marks, str(os.getpid())), "w").close()


def _collect_and_say_what_was_finalized(marks: str) -> list[str]:
    gc.collect()
    return sorted(os.listdir(marks))


def test_a_child_forked_while_a_client_is_open_never_finalizes_what_it_inherited(etcd, tmp_path):
    """The parent's uncollected gRPC objects must not be finalized in the child (fork.py): checked with
    an object of ours in a cycle, collected by the parent after the fork but not by the child."""
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        parent.put("/fork/finalize", "x")
        gc.disable()  # the cycle must still be garbage, uncollected, when the child is forked
        try:
            _Finalized(str(tmp_path))
            got = _run("fork", _collect_and_say_what_was_finalized, str(tmp_path))
        finally:
            gc.enable()
        assert got == ("ok", []), got  # the child collected and finalized nothing it inherited
        gc.collect()
        assert os.listdir(tmp_path) == [str(os.getpid())]  # it was garbage: the parent finalized it


def _close_then_fork(endpoint: str, prefix: str) -> tuple:
    with EtcdClient(endpoint, timeout=3) as parent:
        parent.put(f"{prefix}/parent", "x")
        parent.watch_prefix(f"{prefix}/", 1, lambda events: None)()
    return _run("fork", _put_and_watch, endpoint, f"{prefix}/child")


def _watch_across_a_restart(endpoint: str, ready, restarted) -> tuple:
    with EtcdClient(endpoint, timeout=1) as c:
        seen: list = []
        start = c.put("/w/start", "0")
        cancel = c.watch_prefix("/w/", start + 1, seen.extend)
        kept = KeptLease(c, 2)
        c.put("/w/a", "1", lease=kept.id)
        assert wait_for(lambda: len(seen) == 1)
        ready.set()
        assert restarted.wait(60)
        for _ in range(100):  # written right after the restart: the watch must replay it
            try:
                c.put("/w/b", "2")
                break
            except EtcdConnectionError:
                time.sleep(0.1)
        assert wait_for(lambda: len(seen) == 2, 15), seen
        time.sleep(2.5)  # more than the lease's TTL: its keep-alive must have found the restarted etcd
        alive = (not kept.lost, c.get("/w/a") is not None)
        events = [(e.kind, e.kv.key) for e in seen]
        kept.revoke()
        cancel()
        return events, alive


def test_watch_and_keep_alive_in_a_forked_child_resume_after_etcd_restarts():
    ctx = mp.get_context("fork")
    ready, restarted, queue = ctx.Event(), ctx.Event(), ctx.Queue()
    with EtcdCluster(size=1) as cluster, EtcdClient(cluster.endpoint, timeout=1) as parent:
        parent.put("/held", "x")
        proc = ctx.Process(
            target=_report, args=(queue, _watch_across_a_restart, cluster.endpoint, ready, restarted)
        )
        proc.start()
        try:
            assert ready.wait(30), "the child did not start its watch"
            cluster.restart(0)
            restarted.set()
            got = queue.get(timeout=60)
        finally:
            proc.join(30)
        assert proc.exitcode == 0
    assert got == ("ok", ([("put", "/w/a"), ("put", "/w/b")], (True, True))), got


def test_child_forked_after_the_parent_closed_its_clients_keeps_grpc(etcd, run_id):
    # in a fresh process (spawned: this test process may hold clients of other tests)
    got = _run("spawn", _close_then_fork, etcd.endpoint, f"/{run_id}")
    assert got[0] == "ok" and got[1] == ("ok", "grpc"), got
    with EtcdClient(etcd.endpoint, timeout=3) as client:
        assert client.get(f"/{run_id}/child") is not None


def _use_inherited(client: EtcdClient) -> None:
    try:
        client.put("/fork/inherited", "x")
    finally:
        client.close()  # must not touch the parent's channel


def test_an_inherited_client_refuses_and_says_to_open_a_new_one(etcd, run_id):
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        got = _run("fork", _use_inherited, parent)
        assert got[:2] == ("error", "EtcdForkError"), got
        assert f"created in process {os.getpid()}" in got[2] and "Open a new EtcdClient" in got[2]
        parent.put(f"/{run_id}/after", "y")  # the parent's client is unharmed
        assert parent.get(f"/{run_id}/after").value == b"y"
        assert parent.get("/fork/inherited") is None


def _rendezvous(endpoint: str, run_id: str) -> tuple:
    params = RendezvousParameters(
        "elastic-rm",
        endpoint,
        run_id,
        2,
        2,
        local_addr="127.0.0.1",
        lease_ttl="2",
        last_call_timeout="0.3",
        join_timeout="40",
    )
    handler = create_handler(params)
    try:
        info = handler.next_rendezvous()
        if info.rank == 0:
            info.store.set("probe", b"from-rank-0")
        probe = info.store.get("probe")
        info.store.set(f"done{info.rank}", b"1")
        info.store.wait(["done0", "done1"])  # a shutdown closes the run: not before both have joined
        return info.rank, info.world_size, probe, handler._client.transport
    finally:
        handler.shutdown()


def test_a_rendezvous_across_children_forked_while_the_parent_holds_a_client(etcd, run_id):
    """multiprocessing's 'fork' start method, as torch's agents use by default on Linux."""
    ctx = mp.get_context("fork")
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        parent.put(f"/{run_id}-held", "x")
        queue = ctx.Queue()
        procs = [
            ctx.Process(target=_report, args=(queue, _rendezvous, etcd.endpoint, run_id)) for _ in range(2)
        ]
        for p in procs:
            p.start()
        got = [queue.get(timeout=90) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        assert all(g[0] == "ok" for g in got), got
        results = sorted(g[1] for g in got)
        assert results == [(0, 2, b"from-rank-0", "gateway"), (1, 2, b"from-rank-0", "gateway")]
        assert parent.get(f"/{run_id}-held").value == b"x"


# forkserver starts its children the way spawn does (~3 s each): CI keeps spawn
@pytest.mark.parametrize("method", ["spawn", pytest.param("forkserver", marks=pytest.mark.slow)])
def test_spawned_child_works_while_the_parent_holds_a_client(etcd, run_id, method):
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        parent.put(f"/{run_id}/parent", "x")
        got = _run(method, _put_and_watch, etcd.endpoint, f"/{run_id}/{method}")
        assert got == ("ok", "grpc"), got
        assert parent.get(f"/{run_id}/{method}") is not None
