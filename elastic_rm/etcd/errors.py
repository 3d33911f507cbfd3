"""Errors of the etcd facade. Each message says which endpoint or key and what to do."""

from __future__ import annotations


class EtcdError(Exception):
    """Base of every error the facade raises."""


class EtcdConfigError(EtcdError, ValueError):
    """Bad client options (half a TLS pair, a missing file, a malformed endpoint)."""


class EtcdConnectionError(EtcdError):
    """No endpoint answered within the timeout."""


class EtcdTimeoutError(EtcdConnectionError):
    """A call did not finish in time. For a write the outcome is unknown: re-read before retrying."""


class EtcdCompactedError(EtcdError):
    """A watch asked for a revision etcd has compacted away: re-read the state and watch again."""

    def __init__(self, message: str, compacted_revision: int):
        super().__init__(message)
        self.compacted_revision = compacted_revision


class EtcdAuthError(EtcdError):
    """etcd refused the credentials or the role lacks permission for the key."""


class EtcdForkError(EtcdError):
    """A forked child cannot use etcd through gRPC's asyncio layer while its parent held connections."""
