"""Many leases of one process on shared LeaseKeepAlive streams: each refreshed, a lost one reported alone.

Why: a stream per lease made a process of 128 simulated nodes keep 128 streams that stalled and were
reopened one by one; leases of live nodes expired (benchmarks/scale). etcd's stream takes requests for
any lease ID, so the process keeps a few per cluster and identity (elastic_rm/etcd/keepalive.py).
"""

from __future__ import annotations

import time

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.keepalive import LEASES_PER_STREAM, STREAMS
from elastic_rm.etcd.lease import KeptLease

TIMEOUT = 4.25  # a timeout no other test uses: these clients get a stream of their own


def _refreshed_twice(leases: list[KeptLease], limit_s: float = 20.0) -> bool:
    """Whether every lease got two confirmations after now."""
    start = {lease.id: lease.last_refresh for lease in leases}
    seen = dict.fromkeys(start, 0)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        for lease in leases:
            if lease.last_refresh != start[lease.id]:
                seen[lease.id] += 1
                start[lease.id] = lease.last_refresh
        if all(v >= 2 for v in seen.values()):
            return True
        time.sleep(0.05)
    return False


def test_leases_of_many_clients_share_few_streams_and_each_is_refreshed(etcd, run_id):
    clients = [EtcdClient(etcd.endpoint, timeout=TIMEOUT) for _ in range(4)]
    leases: list[KeptLease] = []
    try:
        opened = STREAMS["opened"]
        leases = [KeptLease(c, 2) for c in clients for _ in range(5)]
        for i, lease in enumerate(leases):
            clients[0].put(f"/{run_id}/k{i}", "x", lease=lease.id)
        assert _refreshed_twice(leases), [lease.last_refresh for lease in leases]
        time.sleep(2.5)  # past the TTL: every key still there, so etcd renewed every lease
        with EtcdClient(etcd.endpoint) as direct:
            kvs, _ = direct.get_prefix(f"/{run_id}/")
        assert len(kvs) == len(leases)
        assert not any(lease.lost for lease in leases)
        # 20 leases of 4 clients: ceil(20 / LEASES_PER_STREAM) streams, not one per lease or per client
        assert STREAMS["opened"] - opened == -(-len(leases) // LEASES_PER_STREAM) < len(clients)
    finally:
        for lease in leases:
            lease.revoke()
        for c in clients:
            c.close()


def test_a_lease_lost_on_the_shared_stream_is_reported_alone(etcd):
    lost: list[int] = []
    with EtcdClient(etcd.endpoint, timeout=TIMEOUT) as client:
        leases = [KeptLease(client, 2, on_lost=lambda i=i: lost.append(i)) for i in range(6)]
        try:
            with EtcdClient(etcd.endpoint) as other:
                other.lease_revoke(leases[2].id)  # etcd forgets this one; its next refresh answers TTL 0
            deadline = time.monotonic() + 10
            while not lost and time.monotonic() < deadline:
                time.sleep(0.05)
            assert lost == [2] and leases[2].lost
            others = [lease for i, lease in enumerate(leases) if i != 2]
            assert _refreshed_twice(others)
            assert lost == [2] and not any(lease.lost for lease in others)
        finally:
            for lease in leases:
                lease.revoke()


def test_closing_a_client_ends_its_leases_refreshes_and_not_the_others(etcd, run_id):
    with EtcdClient(etcd.endpoint, timeout=TIMEOUT) as keeps, EtcdClient(etcd.endpoint) as reader:
        goes = EtcdClient(etcd.endpoint, timeout=TIMEOUT)
        kept, dropped = KeptLease(keeps, 1), KeptLease(goes, 1)
        try:
            reader.put(f"/{run_id}/kept", "x", lease=kept.id)
            reader.put(f"/{run_id}/dropped", "x", lease=dropped.id)
            goes.close()
            deadline = time.monotonic() + 10
            while reader.get(f"/{run_id}/dropped") is not None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert reader.get(f"/{run_id}/dropped") is None  # no longer refreshed: expired
            assert reader.get(f"/{run_id}/kept") is not None and not kept.lost
            assert _refreshed_twice([kept])
        finally:
            kept.revoke()


def test_leases_granted_apart_come_onto_one_refresh_schedule(etcd):
    """A stream's leases granted at different times are refreshed together after a round or two (one
    wake-up and one batch of writes per interval): a lease due within half its interval goes along."""
    leases: list[KeptLease] = []
    with EtcdClient(etcd.endpoint, timeout=4.75) as client:  # a timeout of its own: a stream of its own
        try:
            for _ in range(4):  # granted 0.25 s apart: their first refreshes are due 0.25 s apart
                leases.append(KeptLease(client, 3))
                time.sleep(0.25)
            assert _refreshed_twice(leases)
            # one batch sets every refresh it sends due again one interval on from the same moment: the
            # four leases, first due 0.75 s apart, are now due at one and the same time
            due = {lease._keeper.next_at for lease in leases}
            assert len(due) == 1, due
            assert not any(lease.lost for lease in leases)
        finally:
            for lease in leases:
                lease.revoke()
