"""The lease TTL a node gets without ``--rdzv-conf lease_ttl``: longer for a large job (settings.py)."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rm.rendezvous.settings import (
    DEFAULT_LEASE_TTL,
    LARGE_RUN_LEASE_TTL,
    LARGE_RUN_NODES,
    RendezvousSettings,
)


def settings(max_nodes: int, **conf) -> RendezvousSettings:
    return RendezvousSettings.from_parameters(
        RendezvousParameters("elastic-rm", "127.0.0.1:2379", "run", 1, max_nodes, **conf)
    )


@pytest.mark.parametrize(
    "max_nodes,ttl",
    [
        (1, DEFAULT_LEASE_TTL),
        (LARGE_RUN_NODES - 1, DEFAULT_LEASE_TTL),
        (LARGE_RUN_NODES, LARGE_RUN_LEASE_TTL),
        (1024, LARGE_RUN_LEASE_TTL),
    ],
)
def test_default_lease_ttl_grows_with_the_jobs_max_nodes(max_nodes, ttl):
    s = settings(max_nodes)
    assert s.lease_ttl == ttl
    assert s.peer_probe_s == ttl  # the probe's window follows the TTL


def test_a_lease_ttl_given_wins_at_any_size():
    assert settings(1024, lease_ttl="2").lease_ttl == 2
    assert settings(4, lease_ttl="7").lease_ttl == 7
    assert LARGE_RUN_LEASE_TTL > DEFAULT_LEASE_TTL


def test_a_large_jobs_handler_holds_its_lease_with_the_longer_ttl(etcd, run_id):
    """The default reaches etcd: the lease a node of a 512-node job is granted has the longer TTL."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.rendezvous.registration import create_handler

    params = RendezvousParameters("elastic-rm", etcd.endpoint, run_id, 1, LARGE_RUN_NODES, join_timeout="20")
    handler = create_handler(params)
    try:
        lease = handler._session.lease
        assert lease is not None and lease.ttl == LARGE_RUN_LEASE_TTL
        with EtcdClient(etcd.endpoint) as client:
            assert client.lease_refresh(lease.id) == LARGE_RUN_LEASE_TTL  # etcd's own view of its TTL
    finally:
        handler.release()
