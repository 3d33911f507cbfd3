"""Run a job on a thread of its own, folding requests that come while it runs into one more run.

Why: the event log's trim reads the run's whole log (thousands of keys at 1,000 nodes), and an event may
be emitted on a critical path (a node's "round" event, right before its rank is returned). One thread per
slot (a run's log through one client); a request while it runs means one more run after it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)

_SLOTS: dict[Hashable, list] = {}  # slot -> [the job to run next or None, its thread]
_LOCK = threading.Lock()


def run_soon(slot: Hashable, job: Callable[[], object], name: str = "erm-coalesced") -> None:
    """Run ``job`` on the slot's thread: now, or once more after the run in progress."""
    with _LOCK:
        entry = _SLOTS.get(slot)
        if entry is not None:
            entry[0] = job
            return
        entry = _SLOTS[slot] = [job, None]
        entry[1] = threading.Thread(target=_loop, args=(slot, entry), name=name, daemon=True)
        entry[1].start()


def _loop(slot: Hashable, entry: list) -> None:
    while True:
        with _LOCK:
            job, entry[0] = entry[0], None
            if job is None:
                del _SLOTS[slot]
                return
        try:
            job()
        except Exception as exc:  # noqa: BLE001 - a closed client at exit, etcd gone: the next run retries
            log.debug("background job of %s failed: %s", slot, exc)


def wait_idle(slot: Hashable, timeout_s: float) -> bool:
    """Wait (at most ``timeout_s``) until the slot runs nothing; whether it is idle."""
    with _LOCK:
        entry = _SLOTS.get(slot)
    if entry is None:
        return True
    entry[1].join(max(0.0, timeout_s))
    return not entry[1].is_alive()
