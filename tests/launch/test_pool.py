"""The host pool: free and busy hosts, and Horovod-style blacklisting with a growing cooldown."""

from __future__ import annotations

import pytest

from elastic_rm.launch.hostfile import parse_hosts
from elastic_rm.launch.pool import HostPool


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def pool_of(text: str, **kw) -> tuple[HostPool, Clock]:
    clock = Clock()
    pool = HostPool(clock=clock, **kw)
    for h in parse_hosts(text, "test"):
        pool.add(h)
    return pool, clock


def test_busy_hosts_are_not_free_and_come_back_on_release():
    pool, _ = pool_of("a\nb\nc\n")
    pool.take("b")
    assert [h.name for h in pool.free()] == ["a", "c"]
    pool.release("b")
    assert [h.name for h in pool.free()] == ["a", "b", "c"]


def test_repeated_failures_blacklist_with_a_cooldown_that_doubles():
    pool, clock = pool_of("a\nb\n", failures_to_blacklist=2, cooldown_s=60, max_cooldown_s=100)
    assert pool.failed("a", "refused") is None  # one failure: tried again
    assert [h.name for h in pool.free()] == ["a", "b"]
    assert pool.failed("a", "refused") == 60
    assert [h.name for h in pool.free()] == ["b"] and pool.blacklisted("a")
    clock.now += 59
    assert pool.expired_blacklist() == []
    clock.now += 2
    assert [h.name for h in pool.expired_blacklist()] == ["a"]
    assert pool.expired_blacklist() == []  # reported once
    pool.failed("a", "refused")
    assert pool.failed("a", "refused") == 100  # 120, capped at the maximum


def test_a_node_that_came_up_resets_its_hosts_failure_count():
    pool, _ = pool_of("a\n", failures_to_blacklist=2)
    pool.failed("a", "crash")
    pool.succeeded("a")
    assert pool.failed("a", "crash") is None


def test_invalid_settings_are_refused():
    with pytest.raises(ValueError, match="--host-failures"):
        HostPool(failures_to_blacklist=0)
