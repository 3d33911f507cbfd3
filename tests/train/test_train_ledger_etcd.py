"""The ledger's etcd store against a real etcd (the session fixture of tests/conftest.py)."""

from __future__ import annotations

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.train.ledger import LedgerError, RangeLedger
from elastic_rm.train.ledger_etcd import EtcdLedgerStore


def test_etcd_ledger_store_round_trip_and_leader_guard(etcd, run_id: str) -> None:  # type: ignore[no-untyped-def]
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        key, leader = f"/erm-test/{run_id}/ledger", f"/erm-test/{run_id}/leader"
        c.put(leader, "node-a")
        store = EtcdLedgerStore(c, key, leader_key=leader, leader_value="node-a")
        assert store.load() is None
        led = RangeLedger(100, 10)
        r = led.acquire("w")
        assert r is not None
        led.report(r.id, r.end)
        store.save(led.checkpoint_state())
        again = RangeLedger.from_checkpoint(store.load() or {})
        assert again.done == {0} and again.remaining_samples() == 90
        c.put(leader, "node-b")  # leadership moved: the old leader must not write
        with pytest.raises(LedgerError, match="no longer names this leader"):
            store.save(led.checkpoint_state())
        c.put(key, "{not json")
        with pytest.raises(LedgerError, match="not JSON"):
            store.load()
        c.delete(f"/erm-test/{run_id}", prefix=True)
