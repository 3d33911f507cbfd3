"""The lease keep-alive when answers come late: requests go out on schedule and the stream stays open.

Why: etcd renews a lease when a keep-alive request arrives, not when its answer is read. A keeper that
waited for each answer before the next request, and reopened its stream when one came later than a
refresh interval, turned a slow path (or a process too starved to read its answers) into fewer refreshes
and a reopened stream per lease (the scale benchmark's 128 leases per process).
"""

from __future__ import annotations

import logging
import signal
import socket
import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.keepalive import REOPENS
from elastic_rm.etcd.lease import KeptLease
from elastic_rm.etcd.server import EtcdCluster
from tests.etcd.test_client import _is_leader
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


def test_a_keepalive_whose_member_goes_silent_fails_over_to_a_member_with_a_leader_within_its_ttl(caplog):
    """The member this client uses stops answering (SIGSTOP: its connections stay open, silent, as under a
    partition), and the next endpoint in the list is silent too. The keep-alive, on the client's I/O loop,
    asks the others at once and moves straight to the live member, and the lease (TTL 5 s) is kept.

    Why: the keep-alive called the blocking failover on the loop that the probe runs on. The loop (every
    etcd call of the process) stood still for the probe's whole deadline, the probe found nothing, and the
    list order then took the next endpoint: the netns raft-leader partition lost leases in every run."""
    silent = socket.create_server(("127.0.0.1", 0), backlog=16)  # connects complete; nothing ever answers
    try:
        with EtcdCluster(size=3) as cluster:
            # a follower goes silent: a member keeps naming a dead leader until its election timeout, and
            # a keep-alive sent there in the election waits on it (the next failover moves on; not this
            # test's)
            deadline = time.monotonic() + 20
            followers = []
            while len(followers) != 2 and time.monotonic() < deadline:  # until the first election is over
                followers = [i for i, e in enumerate(cluster.endpoints) if not _is_leader(e)]
            assert len(followers) == 2, followers
            stopped, leader = followers[0], 3 - sum(followers)
            first, other = cluster.endpoints[stopped], cluster.endpoints[leader]
            endpoints = [first, f"127.0.0.1:{silent.getsockname()[1]}", other]
            with EtcdClient(endpoints, timeout=1) as client, EtcdClient(other, timeout=5) as witness:
                lease = KeptLease(client, 5)
                assert lease.last_refresh > 0 and client.endpoint == first
                with caplog.at_level(logging.WARNING, logger="elastic_rm.etcd.connection"):
                    cluster.kill(stopped, signal.SIGSTOP)
                    try:
                        deadline = time.monotonic() + 8
                        while time.monotonic() < deadline and not lease.lost:
                            time.sleep(0.1)
                        assert not lease.lost and witness.lease_refresh(lease.id) > 0  # alive in etcd
                    finally:
                        cluster.kill(stopped, signal.SIGCONT)
                switches = [
                    r.getMessage() for r in caplog.records if "switching to endpoint" in r.getMessage()
                ]
                assert switches and switches[0] == f"etcd: switching to endpoint {other}", switches
                lease.revoke()
    finally:
        silent.close()
