"""The plain values the etcd facade hands out: keys with their revisions, watch events, transaction results.

Its own module so that the client and the watch both use them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "put" or "delete"
    kv: KeyValue  # for a delete: the key, empty value, mod_revision = revision of the deletion


@dataclass(frozen=True)
class TxnResult:
    succeeded: bool
    revision: int  # the store revision after the transaction (its own revision when it wrote)
    kvs: tuple[KeyValue, ...] = ()  # values read by Get operations in the branch that ran


def key_value(raw: Any) -> KeyValue:
    """A :class:`KeyValue` from aetcd's protobuf key-value."""
    return KeyValue(
        key=raw.key.decode(),
        value=bytes(raw.value),
        create_revision=int(raw.create_revision),
        mod_revision=int(raw.mod_revision),
        version=int(raw.version),
        lease=int(raw.lease),
    )
