"""The lease keep-alive when answers come late: requests go out on schedule and the stream stays open.

Why: etcd renews a lease when a keep-alive request arrives, not when its answer is read. A keeper that
waited for each answer before the next request, and reopened its stream when one came later than a
refresh interval, turned a slow path (or a process too starved to read its answers) into fewer refreshes
and a reopened stream per lease (the scale benchmark's 128 leases per process).
"""

from __future__ import annotations

import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.keepalive import REOPENS
from elastic_rm.etcd.lease import KeptLease
from tests.netns.delay_proxy import DelayProxy


def test_a_lease_whose_answers_come_later_than_its_refresh_interval_is_confirmed_without_reopening(etcd):
    # 0.45 s each way: every answer comes 0.9 s after its request, later than the refresh interval
    # (TTL 2 s / 3) and sooner than the TTL
    with (
        DelayProxy("127.0.0.1", etcd.endpoint, 0.45) as proxy,
        EtcdClient(proxy.endpoint, timeout=5) as client,
    ):
        lease = KeptLease(client, 2)
        try:
            before = dict(REOPENS)
            confirmed, last = 0, lease.last_refresh
            deadline = time.monotonic() + 30
            while confirmed < 6 and time.monotonic() < deadline and not lease.lost:
                time.sleep(0.05)
                if lease.last_refresh != last:
                    confirmed, last = confirmed + 1, lease.last_refresh
            assert confirmed >= 6 and not lease.lost, (confirmed, lease.lost)
            assert REOPENS == before, f"the keep-alive stream was reopened: {before} -> {REOPENS}"
            with EtcdClient(etcd.endpoint, timeout=5) as direct:
                assert direct.lease_refresh(lease.id) > 0  # alive in etcd
        finally:
            lease.revoke()
