"""Transaction guards and operations, as thin builders over aetcd's (keys are str, values bytes or str)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import aetcd
import aetcd.exceptions as aexc
from aetcd import rpc


class Compare:
    """Transaction guards, built with the class methods: ``Compare.mod(key, rev)``..."""

    def __init__(self, target: str, key: str, op: str, value: Any):
        self.target, self.key, self.op, self.value = target, key, op, value

    @classmethod
    def mod(cls, key: str, revision: int, op: str = "==") -> Compare:
        return cls("mod", key, op, revision)

    @classmethod
    def create(cls, key: str, revision: int, op: str = "==") -> Compare:
        return cls("create", key, op, revision)

    @classmethod
    def value_is(cls, key: str, value: bytes | str, op: str = "==") -> Compare:
        return cls("value", key, op, value.encode() if isinstance(value, str) else value)

    @classmethod
    def absent(cls, key: str) -> Compare:
        return cls("create", key, "==", 0)

    def build(self) -> Any:
        kinds = {
            "mod": aetcd.transactions.Mod,
            "create": aetcd.transactions.Create,
            "value": aetcd.transactions.Value,
        }
        target = kinds[self.target](self.key.encode())
        ops = {"==": target.__eq__, "!=": target.__ne__, "<": target.__lt__, ">": target.__gt__}
        return ops[self.op](self.value)


class Op:
    """Transaction operations: ``Op.put(key, value, lease)``, ``Op.delete(key)``, ``Op.get(key)``."""

    @staticmethod
    def put(key: str, value: bytes | str, lease: int | None = None) -> Any:
        data = value.encode() if isinstance(value, str) else value
        return aetcd.transactions.Put(key.encode(), data, lease=lease or None)

    @staticmethod
    def delete(key: str, prefix: bool = False) -> Any:
        end = aetcd.utils.prefix_range_end(key.encode()) if prefix else None
        return aetcd.transactions.Delete(key.encode(), range_end=end)

    @staticmethod
    def delete_range(start: str, end: str) -> Any:
        """Every key in [start, end), in key order."""
        return aetcd.transactions.Delete(start.encode(), range_end=end.encode())

    @staticmethod
    def get(key: str) -> Any:
        return aetcd.transactions.Get(key.encode())


async def send_range(c: Any, request: Any, timeout: float) -> Any:
    """One range request (aetcd's get_prefix has no limit or revision) with aetcd's client ``c``, answered
    within ``timeout`` seconds."""
    await c.connect()
    try:
        return await c.kvstub.Range(request, timeout=timeout, metadata=c.metadata)
    except rpc.AioRpcError as exc:
        aexc._handle_exception(exc)


async def send_txn(
    c: Any,
    timeout: float,
    compare: Sequence[Compare] = (),
    success: Sequence[Any] = (),
    failure: Sequence[Any] = (),
) -> Any:
    """One transaction (``compare``, then ``success`` or ``failure`` ops from :class:`Op`) with aetcd's
    client ``c``, answered within ``timeout`` seconds: etcd's TxnResponse, or gRPC's error raised as
    aetcd's."""
    await c.connect()
    request = rpc.TxnRequest(
        compare=[cmp.build().build_message() for cmp in compare],
        success=c._ops_to_requests(list(success)),
        failure=c._ops_to_requests(list(failure)),
    )
    try:
        return await c.kvstub.Txn(request, timeout=timeout, metadata=c.metadata)
    except rpc.AioRpcError as exc:
        aexc._handle_exception(exc)
