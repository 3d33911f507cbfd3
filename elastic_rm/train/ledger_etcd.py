"""The data ledger's state under one etcd key, written by the leader only.

The checkpoint manifest stays the source of truth for what is done (it commits with the model state);
this copy lets a new leader, or `erm status`, see the latest progress between checkpoints. Values are
JSON; a malformed value is an error naming the key.
"""

from __future__ import annotations

import json
from typing import Any

from elastic_rm.etcd.client import Compare, EtcdClient, Op
from elastic_rm.train.ledger import LedgerError


class EtcdLedgerStore:
    """`save` is one transaction guarded by `leader_key == leader_value` when both are given, so a
    deposed leader cannot overwrite its successor's ledger."""

    def __init__(
        self, client: EtcdClient, key: str, leader_key: str | None = None, leader_value: str | None = None
    ) -> None:
        if (leader_key is None) != (leader_value is None):
            raise ValueError("give both leader_key and leader_value, or neither")
        self.client, self.key = client, key
        self.leader_key, self.leader_value = leader_key, leader_value

    def load(self) -> dict[str, Any] | None:
        kv = self.client.get(self.key)
        if kv is None:
            return None
        try:
            state = json.loads(kv.value)
        except (ValueError, RecursionError) as e:  # RecursionError: absurd nesting
            raise LedgerError(
                f"etcd key {self.key}: ledger state is not JSON ({e}); delete the key"
            ) from None
        if not isinstance(state, dict):
            raise LedgerError(f"etcd key {self.key}: ledger state is not a JSON object; delete the key")
        return state

    def save(self, state: dict[str, Any]) -> None:
        data = json.dumps(state, sort_keys=True)
        if self.leader_key is None:
            self.client.put(self.key, data)
            return
        assert self.leader_value is not None
        res = self.client.txn(
            [Compare.value_is(self.leader_key, self.leader_value)], [Op.put(self.key, data)]
        )
        if not res.succeeded:
            raise LedgerError(
                f"not saving the ledger to {self.key}: {self.leader_key} no longer names this leader "
                f"({self.leader_value!r}); only the current leader writes the ledger"
            )
