"""Requests folded into one more run: the run after the last request always happens (driven by hand)."""

from __future__ import annotations

import threading

from elastic_rm.obs.coalesced import run_soon, wait_idle


def test_requests_during_a_run_make_one_more_run_with_the_last_job():
    slot = object()
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()

    def first() -> None:
        ran.append("first")
        started.set()
        release.wait(30)

    run_soon(slot, first)
    assert started.wait(30)
    run_soon(slot, lambda: ran.append("second"))  # folded: the third replaces it
    run_soon(slot, lambda: ran.append("third"))
    assert not wait_idle(slot, 0.0)  # the first still runs
    release.set()
    assert wait_idle(slot, 30)
    assert ran == ["first", "third"]
    run_soon(slot, lambda: ran.append("fourth"))  # an idle slot starts afresh
    assert wait_idle(slot, 30)
    assert ran == ["first", "third", "fourth"]


def test_a_failing_job_does_not_stop_the_next():
    slot = object()
    ran: list[str] = []
    started, release = threading.Event(), threading.Event()

    def failing() -> None:
        started.set()
        release.wait(30)
        raise RuntimeError("etcd gone")

    run_soon(slot, failing)
    assert started.wait(30)
    run_soon(slot, lambda: ran.append("next"))
    release.set()
    assert wait_idle(slot, 30)
    assert ran == ["next"]
