"""The process's one etcd I/O thread: an asyncio loop that every EtcdClient of the process shares."""

from __future__ import annotations

import asyncio
import os
import threading

_IO_LOOP: asyncio.AbstractEventLoop | None = None
_IO_LOCK = threading.Lock()
_INHERITED: list[asyncio.AbstractEventLoop] = []  # a forked child's parent loops: kept, never finalized


def io_loop() -> asyncio.AbstractEventLoop:
    """One I/O thread per process, shared by every client in it (each keeps its own connection).

    With a thread and an event loop per client, a process with many clients (the benchmarks simulate many
    nodes in one process) spends its time switching between idle loops. Callbacks on this loop must never
    block.
    """
    global _IO_LOOP
    with _IO_LOCK:
        if _IO_LOOP is None or _IO_LOOP.is_closed():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="etcd-io", daemon=True).start()
            _IO_LOOP = loop
        return _IO_LOOP


def _forget_io_loop_in_child() -> None:
    global _IO_LOOP
    if _IO_LOOP is not None:  # its finalizer would close what the parent's gRPC channels registered on it
        _INHERITED.append(_IO_LOOP)
    _IO_LOOP = None  # the parent's I/O thread does not exist in a forked child


os.register_at_fork(after_in_child=_forget_io_loop_in_child)
