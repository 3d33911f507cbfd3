"""The etcd facade across fork(): which transport a process uses, and a clear error for inherited clients.

gRPC's asyncio layer does not survive fork() while it is up (a fresh gRPC client in such a child times out
or crashes, with or without GRPC_ENABLE_FORK_SUPPORT; grpc/grpc#19793). It is up while a channel
lives: an open client, or a closed client's calls that sit in reference cycles until the garbage collector
runs, and until gRPC's own threads have ended. So:

- a process forked while gRPC was down (no client open; before such a fork this module collects that
  garbage and waits, bounded, for gRPC's threads to end) uses gRPC, as every other process does;
- a process forked while gRPC was up (or from such a process) uses etcd's JSON gateway instead
  (gateway.py): every facade call works there, slower per call (benchmarks/etcd_transport). gRPC core's
  own fork handlers, which can make such a child die of SIGSEGV, are turned off in __init__.py;
- a client inherited from the parent belongs to the parent: using it in the child raises EtcdForkError at
  once (its connection, watches and keep-alives live in the parent), saying to open a new one;
- such a child never frees what it inherited: its garbage collector would finalize the parent's gRPC
  objects (channels, calls left in reference cycles), and their finalizers call into gRPC core, whose
  locks may name parent threads that do not exist in the child (even a child that uses only the gateway
  can die of SIGABRT in gRPC's mutex code, "Mutex::Fer with pending CondVar queueing"). So the after-fork
  hook freezes the inherited objects (gc.freeze: the child's collections never look at them; they stay
  shared with the parent's pages, too).
"""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

from .errors import EtcdForkError

FORK_SETTLE_S = 0.1  # without /proc: gRPC ends a closed channel's threads asynchronously, give it this
FORK_WAIT_S = 2.0  # at most this long for gRPC's poller thread to end before a fork
ADVICE = (
    "a client's connection, watches and lease keep-alives stay in the process that created it. Open a new "
    "EtcdClient (or rendezvous handler) in this process: that works after fork"
)

_open: weakref.WeakSet = weakref.WeakSet()  # clients created and not closed in this process
_used = False  # a client was ever created here (gRPC may be up)
_last_close = 0.0  # time.monotonic() when a client of this process last closed
_up_at_fork = False  # set by the pre-fork hook for the child to read
_forked_from: int | None = None  # the parent's pid, when this process (or an ancestor) forked with gRPC up


def opened(client: object) -> None:
    global _used
    _used = True
    _open.add(client)


def closed(client: object) -> None:
    global _last_close
    _open.discard(client)
    _last_close = time.monotonic()


def gateway_needed() -> bool:
    """True in a process forked while gRPC was up in its parent: gRPC cannot be used here."""
    return _forked_from is not None


def check_owner(pid: int) -> None:
    if os.getpid() != pid:
        raise EtcdForkError(
            f"this etcd client was created in process {pid} and cannot be used in its forked child "
            f"{os.getpid()}: {ADVICE}"
        )


def _grpc_pollers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if "_poll_wrapper" in t.name]  # grpc.aio's poller thread


GRPC_THREADS = ("grpc_", "event_engine", "lifeguard")  # gRPC core's native threads, as Linux names them


def _grpc_native_threads() -> int | None:
    """How many of gRPC core's own threads run in this process (None where /proc cannot tell)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    count = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                count += fh.read().startswith(GRPC_THREADS)
        except OSError:
            continue  # the thread ended meanwhile
    return count


def _grpc_down_within(deadline: float) -> bool:
    """Collect closed clients' leftover calls, then wait until gRPC's poller and core threads ended:
    they end shortly after the last channel is gone."""
    gc.collect()  # closed clients' calls in reference cycles keep gRPC up until collected
    for t in _grpc_pollers():
        t.join(max(0.0, deadline - time.monotonic()))
    while True:
        native = _grpc_native_threads()
        if native is None:  # no /proc: give gRPC a settle time instead
            time.sleep(max(0.0, min(_last_close + FORK_SETTLE_S - time.monotonic(), FORK_SETTLE_S)))
            return not _grpc_pollers()
        if native == 0 and not _grpc_pollers():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def _before_fork() -> None:
    global _up_at_fork
    _up_at_fork = bool(len(_open))
    if _up_at_fork or not _used:  # clients open, or gRPC never used here
        return
    _up_at_fork = not _grpc_down_within(time.monotonic() + FORK_WAIT_S)


def _after_fork_in_child() -> None:
    global _forked_from
    if (_up_at_fork or len(_open)) and _forked_from is None:
        _forked_from = os.getppid()
    if _forked_from is not None:
        gc.freeze()  # never finalize the parent's gRPC objects here (module docstring)
    _open.clear()  # the inherited clients are unusable here (check_owner); never touch their channels


os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
