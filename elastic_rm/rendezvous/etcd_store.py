"""A ``torch.distributed.Store`` in etcd: the agents' store for one round.

torch's agent uses the rendezvous store for rank assignment and its exit barrier: a few keys per round.
Keeping it in etcd (under ``store/<round>/``) means no extra server in any agent, nothing to reconnect
when the node that would have hosted it dies, and no per-connection DNS lookups (a TCPStore server
resolves every client's name: a slow resolver stalls every agent's connect). Workers
never use it: their MASTER_ADDR/MASTER_PORT point at a store hosted by global rank 0, as torch's
dynamic handler does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so training traffic stays off etcd.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

from torch.distributed import DistStoreError, Store

from ..etcd.client import Compare, EtcdClient, Op

_MAX_CAS_ATTEMPTS = 1000


def _bytes(value: str | bytes | bytearray) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class RoundSupersededError(DistStoreError):
    """A newer round was written while this round's members were still exchanging ranks in its store (a
    member died right after the round was sealed): waiting for the dead member would last until the
    timeout, so the wait ends at once and the agent joins the newer round."""


class RunClosedError(DistStoreError):
    """The run was closed while this node waited for keys of its round's store: whoever closed it has
    finished (or failed) and will never write them. Raised instead of waiting for the timeout (torch's
    exit barrier waits 300 s for a node whose workers failed after the others had finished)."""


class EtcdStore(Store):
    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        timeout: float = 300.0,
        superseded: Callable[[], bool] | None = None,
        closed: Callable[[], str | None] | None = None,
    ):
        """``superseded``: asked while waiting for keys; True ends the wait with RoundSupersededError.
        ``closed``: likewise; who closed the run (None while open) ends it with RunClosedError."""
        super().__init__()
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._timeout = timeout
        self._superseded = superseded
        self._closed = closed

    def _key(self, key: str) -> str:
        return self._prefix + key

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout.total_seconds()

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        self.wait([key])
        kv = self._client.get(self._key(key))
        if kv is None:
            raise DistStoreError(f"key {key!r} vanished from the etcd store {self._prefix}")
        return kv.value

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        for _ in range(_MAX_CAS_ATTEMPTS):
            kv = self._client.get(full)
            current = int(kv.value) if kv is not None else 0
            guard = Compare.mod(full, kv.mod_revision) if kv is not None else Compare.absent(full)
            if self._client.txn([guard], [Op.put(full, str(current + amount))]).succeeded:
                return current + amount
        raise DistStoreError(f"add({key!r}) lost {_MAX_CAS_ATTEMPTS} races in the etcd store {self._prefix}")

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        full, want, new = self._key(key), _bytes(expected), _bytes(desired)
        guard = Compare.absent(full) if not want else Compare.value_is(full, want)
        result = self._client.txn([guard], [Op.put(full, new)], [Op.get(full)])
        if result.succeeded:
            return new
        return result.kvs[0].value if result.kvs else want

    def peek(self, key: str) -> bytes | None:
        """The key's value now, None when it is not there (no wait)."""
        kv = self._client.get(self._key(key))
        return None if kv is None else kv.value

    def check(self, keys: list[str]) -> bool:
        return all(self._client.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = timeout.total_seconds() if timeout is not None else self._timeout
        deadline, delay = time.monotonic() + limit, 0.002
        pending = list(keys)
        while pending:
            pending = [k for k in pending if self._client.get(self._key(k)) is None]
            if not pending:
                return
            if self._superseded is not None and self._superseded():
                raise RoundSupersededError(
                    f"a newer round superseded the one of etcd store {self._prefix} while waiting for keys "
                    f"{pending}: join the newer round"
                )
            by = self._closed() if self._closed is not None else None
            if by is not None:
                raise RunClosedError(
                    f"the run was closed (by {by}) while waiting for keys {pending} "
                    f"in etcd store {self._prefix}"
                )
            if time.monotonic() > deadline:
                raise DistStoreError(
                    f"wait timeout after {limit:.0f}s for keys {pending} in etcd store {self._prefix}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.05)

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._key(key))

    def num_keys(self) -> int:
        return len(self._client.get_prefix(self._prefix)[0])
