"""Watches that outlive etcd's history: a client cut off from etcd (a TCP proxy that drops and refuses its
connections) while others write and etcd compacts, then reconnected. The watch must re-read the state at
the current revision, hand it over as a resync (or, for a consumer without one, a catch-up plus an error
saying what it cannot show), and resume after it: never stuck, never older than what it re-read."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from elastic_rm.etcd.client import EtcdClient, KeyValue, WatchEvent
from elastic_rm.etcd.errors import EtcdCompactedError, EtcdError
from elastic_rm.etcd.server import EtcdCluster
from tests.etcd.cutoff_proxy import CutoffProxy


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout}s waiting for {what}"
        time.sleep(0.05)


def compact(client: EtcdClient) -> int:
    """Compact etcd's history up to the current revision (as auto-compaction does); returns it."""
    revision = client.ping()
    client.run(lambda c: c.compact(revision, physical=True))
    return revision


def test_a_watch_cut_off_past_a_compaction_resyncs_or_catches_up(caplog) -> None:
    with (
        EtcdCluster(size=1) as cluster,
        CutoffProxy(cluster.endpoint) as proxy,
        EtcdClient(cluster.endpoint, timeout=2) as writer,
        EtcdClient(proxy.endpoint, timeout=1) as cut_off,
    ):
        writer.put("/w/a", "0")
        start = writer.put("/w/gone", "x")
        lock = threading.Lock()
        events: list[tuple[str, WatchEvent | tuple[list[KeyValue], int]]] = []  # both watches, in order
        errors: list[EtcdError] = []

        def record(tag: str) -> Callable:
            def on(item) -> None:
                with lock:
                    events.append((tag, item))

            return on

        def on_events(tag: str) -> Callable[[list[WatchEvent]], None]:
            return lambda evs: [record(tag)(e) for e in evs]

        cancels = [
            cut_off.watch_prefix(
                "/w/",
                start + 1,
                on_events("R"),
                None,
                on_resync=lambda kvs, rev: record("R-resync")((kvs, rev)),
            ),
            cut_off.watch_prefix("/w/", start + 1, on_events("C"), errors.append),
        ]
        writer.put("/w/a", "1")
        wait_for(lambda: len(events) == 2, 10, "both watches to see /w/a=1")

        proxy.cut()
        for i in range(2, 41):
            writer.put("/w/a", str(i))
        writer.delete("/w/gone")
        writer.put("/w/new", "y")
        compacted = compact(writer)
        time.sleep(1.5)  # the cut-off watches try to resume meanwhile, and fail
        with lock:
            assert len(events) == 2, events

        with caplog.at_level("WARNING"):
            proxy.heal()
            wait_for(lambda: any(t == "R-resync" for t, _ in events), 15, "the resync")
            wait_for(lambda: errors, 15, "the catch-up's error")
            after = writer.put("/w/after", "z")
            wait_for(lambda: sum(t in ("R", "C") for t, _ in events) >= 6, 10, "the events after the resync")
        for cancel in cancels:
            cancel()

        with lock:
            resync = [item for t, item in events if t == "R-resync"]
            r_events = [item for t, item in events if t == "R"]
            c_events = [item for t, item in events if t == "C"]
        assert len(resync) == 1
        kvs, revision = resync[0]
        assert revision >= compacted
        assert {kv.key: kv.value for kv in kvs} == {"/w/a": b"40", "/w/new": b"y"}  # /w/gone is gone
        assert [(e.kind, e.kv.key, e.kv.value) for e in r_events] == [
            ("put", "/w/a", b"1"),
            ("put", "/w/after", b"z"),
        ]
        assert r_events[1].kv.mod_revision == after > revision
        # without on_resync: the keys changed meanwhile as puts in revision order, then on from there
        assert [(e.kind, e.kv.key, e.kv.value) for e in c_events] == [
            ("put", "/w/a", b"1"),
            ("put", "/w/a", b"40"),
            ("put", "/w/new", b"y"),
            ("put", "/w/after", b"z"),
        ]
        assert len(errors) == 1 and isinstance(errors[0], EtcdCompactedError)
        assert "not shown" in str(errors[0])
        assert "is compacted" in caplog.text and f"resuming from {revision + 1}" in caplog.text


def test_a_paged_prefix_read_compacted_between_pages_reads_again_at_a_newer_revision(run_id) -> None:
    """`erm status` at 1,024 nodes failed with "required revision has been compacted": its pages are read
    at the first page's revision, and a busy run's writes let etcd compact it meanwhile."""
    with EtcdCluster(size=1) as own, EtcdClient(own.endpoint, timeout=5) as c:  # compacts: not the shared one
        for i in range(6):
            c.put(f"/{run_id}/k{i}", str(i))
        pages = {"n": 0}
        run = c.run

        def compacting_run(make, retry=True):
            out = run(make, retry)
            pages["n"] += 1
            if pages["n"] == 1:  # after the first page: a write, then a compaction past the read revision
                c.put(f"/{run_id}/k9", "9")
                compact(c)
            return out

        c.run = compacting_run  # type: ignore[method-assign]
        kvs, revision = c.get_prefix(f"/{run_id}/", page=2)
        c.run = run  # type: ignore[method-assign]
        assert [kv.key for kv in kvs] == [f"/{run_id}/k{i}" for i in (0, 1, 2, 3, 4, 5, 9)]
        assert revision >= kvs[-1].mod_revision
