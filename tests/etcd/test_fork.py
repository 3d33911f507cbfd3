"""The etcd facade across fork(): what works in a forked child, and a clear error for what cannot.

gRPC's asyncio layer does not survive fork() while a channel is open (a fresh client in such a child
timed out or crashed in our probe). These tests pin the supported cases with real processes: a child
forked while no client is open, a spawned child while one is, and the prompt error otherwise.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from elastic_rm.etcd.client import EtcdClient


def _child_put(endpoint: str, key: str, queue) -> None:
    """Opens its own client and writes ``key``; reports ("ok", seconds) or ("error", type, message)."""
    started = time.monotonic()
    try:
        with EtcdClient(endpoint, timeout=3) as client:
            client.put(key, str(os.getpid()))
            seen = []
            cancel = client.watch_prefix(key, 1, seen.extend, exact=True)
            cancel()
        queue.put(("ok", time.monotonic() - started))
    except Exception as exc:  # noqa: BLE001 - reported to the parent as data
        queue.put(("error", type(exc).__name__, str(exc)))


def _child_uses_inherited(client: EtcdClient, queue) -> None:
    try:
        client.put("/fork/inherited", "x")
        queue.put(("ok",))
    except Exception as exc:  # noqa: BLE001
        queue.put(("error", type(exc).__name__, str(exc)))
    client.close()  # must not touch the parent's channel


def _run(ctx_name: str, target, args) -> tuple:
    ctx = mp.get_context(ctx_name)
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0, f"child exited with {proc.exitcode}"
    return queue.get(timeout=5)


def _close_then_fork(endpoint: str, prefix: str, queue) -> None:
    """A fresh process (spawned: this test process may hold clients of other tests) that uses a client,
    closes it, then forks a child that opens its own."""
    with EtcdClient(endpoint, timeout=3) as parent:
        parent.put(f"{prefix}/parent", "x")
        cancel = parent.watch_prefix(f"{prefix}/", 1, lambda events: None)
        cancel()
    queue.put(_run("fork", _child_put, (endpoint, f"{prefix}/child")))


def test_child_forked_after_the_parent_closed_its_clients_works(etcd, run_id):
    got = _run("spawn", _close_then_fork, (etcd.endpoint, f"/{run_id}"))
    assert got[0] == "ok", got
    with EtcdClient(etcd.endpoint, timeout=3) as client:
        assert client.get(f"/{run_id}/child") is not None


def test_child_forked_while_a_client_is_open_is_refused_with_advice(etcd, run_id):
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        parent.put(f"/{run_id}/parent", "x")
        got = _run("fork", _child_put, (etcd.endpoint, f"/{run_id}/child"))
        assert got[:2] == ("error", "EtcdForkError"), got
        assert "'spawn'" in got[2] and "forked from" in got[2]
        got = _run("fork", _child_uses_inherited, (parent,))
        assert got[:2] == ("error", "EtcdForkError"), got
        assert f"created in process {os.getpid()}" in got[2]
        parent.put(f"/{run_id}/after", "y")  # the parent's client is unharmed
        assert parent.get(f"/{run_id}/child") is None
        assert parent.get(f"/{run_id}/after").value == b"y"


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_spawned_child_works_while_the_parent_holds_a_client(etcd, run_id, method):
    with EtcdClient(etcd.endpoint, timeout=3) as parent:
        parent.put(f"/{run_id}/parent", "x")
        got = _run(method, _child_put, (etcd.endpoint, f"/{run_id}/{method}"))
        assert got[0] == "ok", got
        assert parent.get(f"/{run_id}/{method}") is not None
