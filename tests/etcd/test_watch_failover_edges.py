"""A watch whose channel is closed under it by another call's failover must resume on the new channel.

gRPC's asyncio layer ends a call in flight on a channel that is closed with ``asyncio.CancelledError``
(not a task cancellation). A failover (connection.py) closes the channel it leaves. A watch that was
re-reading its prefix after a compaction (its one unary call) when that happened took the error for its
own cancellation and ended: no event under the prefix was delivered again, silently (a node's view of
``round`` frozen: a hang, or a node acting on a stale round)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

from elastic_rm.etcd import fork
from elastic_rm.etcd.client import EtcdClient, KeyValue, WatchEvent
from elastic_rm.etcd.server import EtcdCluster
from tests.etcd.cutoff_proxy import CutoffProxy


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.01)


def test_a_watch_resyncing_when_a_failover_closes_its_channel_resumes_on_the_new_one() -> None:
    with (
        EtcdCluster(size=1) as cluster,  # compacts: not the shared one
        CutoffProxy(cluster.endpoint, answer_delay_s=0.01) as slow,  # never cut
        CutoffProxy(cluster.endpoint) as other,  # a second endpoint to fail over to (never cut)
        EtcdClient(cluster.endpoint, timeout=5) as writer,
        EtcdClient([slow.endpoint, other.endpoint], timeout=10) as client,
    ):
        big = b"x" * (1 << 20)
        for i in range(12):  # a 12 MiB prefix: its re-read takes ~2 s through the slow proxy
            writer.put(f"/w/k{i:02d}", big)
        revision = writer.ping()
        writer.run(lambda c: c.compact(revision, physical=True))

        lock = threading.Lock()
        resyncs: list[tuple[list[KeyValue], int]] = []
        events: list[WatchEvent] = []

        def on_resync(kvs: list[KeyValue], rev: int) -> None:
            with lock:
                resyncs.append((kvs, rev))

        def on_events(evs: list[WatchEvent]) -> None:
            with lock:
                events.extend(evs)

        client.ping()
        conn = client._conn
        first = conn.current()
        before = slow.down_bytes
        # from revision 1, compacted: the watch re-reads the prefix at once
        cancel = client.watch_prefix("/w/", 1, on_events, None, on_resync=on_resync)
        wait_for(lambda: slow.down_bytes - before > 1 << 20, 10, "the re-read to be under way")
        assert not resyncs, "the re-read finished before the failover: the proxy is not slow enough"
        conn.fail_over_blocking(first)  # what a call of another thread that failed on this channel does
        assert conn.current() is not first

        wait_for(lambda: resyncs, 15, "the re-read on the new endpoint")
        after = writer.put("/w/after", "z")
        wait_for(lambda: any(e.kv.key == "/w/after" for e in events), 10, "the write after the failover")
        cancel()
        with lock:
            assert len(resyncs[0][0]) == 12
            assert [(e.kind, e.kv.key, e.kv.mod_revision) for e in events] == [("put", "/w/after", after)]


def test_a_gateway_watch_whose_client_a_failover_closes_between_two_answers_resumes(monkeypatch) -> None:
    """Over etcd's JSON gateway (a process forked while gRPC was up, fork.py) each watch stream is read by a
    thread. A failover closes the client it leaves, and with it the stream; a close that came while that
    thread was between two answers ended its loop without a last item, and the watch waited for one
    forever (under a steady stream of writes, at the first or second failover)."""
    with (
        EtcdCluster(size=1) as cluster,
        CutoffProxy(cluster.endpoint) as other,  # a second endpoint to fail over to (never cut)
        EtcdClient(cluster.endpoint, timeout=5) as writer,  # over gRPC: created before the switch below
    ):
        monkeypatch.setattr(fork, "_forked_from", os.getppid())  # this process talks to the gateway
        with EtcdClient([cluster.endpoint, other.endpoint], timeout=2) as client:
            assert client.transport == "gateway"
            lock = threading.Lock()
            seen: set[str] = set()

            def on_events(evs: list[WatchEvent]) -> None:
                with lock:
                    seen.update(e.kv.key for e in evs)

            cancel = client.watch_prefix("/w/", writer.ping() + 1, on_events)
            stop = threading.Event()

            def noise() -> None:  # answers keep coming: a close often falls between two of them
                for i in range(100_000):
                    if stop.is_set():
                        return
                    writer.put("/w/noise", str(i))

            thread = threading.Thread(target=noise, daemon=True)
            thread.start()
            try:
                for i in range(10):
                    client._conn.fail_over_blocking(client._conn.current())
                    writer.put(f"/w/mark{i}", "x")
                    wait_for(lambda i=i: f"/w/mark{i}" in seen, 10, f"the write after failover {i}")
            finally:
                stop.set()
                thread.join(10)
                cancel()
