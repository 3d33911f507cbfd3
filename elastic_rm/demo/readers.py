"""What etcd recorded of a demo run: the sealed rounds, the leader's decisions and their measured outcomes.
Read after (or during) the run from the run's keys, so the summary shows what the cluster did, not what
the harness intended."""

from __future__ import annotations

from ..etcd.client import EtcdClient
from ..obs.events import Event, read_etcd
from ..wire.keyspace import DEFAULT_PREFIX, Keyspace
from ..wire.records import effective_rounds

ETCD_TIMEOUT_S = 5.0


def rounds_from_etcd(endpoint: str, run_id: str) -> list[dict]:
    """The sealed rounds of the run, as recorded by the leader under rounds/<n>/record."""
    keys = Keyspace(DEFAULT_PREFIX, run_id)
    errors: list[str] = []
    with EtcdClient(endpoint, timeout=ETCD_TIMEOUT_S) as client:
        kvs, _ = client.get_prefix(keys.rounds)
    out = [
        {"round": r.round, "members": list(r.members), "reason": r.reason, "t": r.time}
        for r in effective_rounds(kvs, errors)
    ]
    return out + [{"round": None, "error": e} for e in errors]


def _events(endpoint: str, run_id: str) -> list[Event]:
    with EtcdClient(endpoint, timeout=ETCD_TIMEOUT_S) as client:
        found, _errors, _ = read_etcd(client, Keyspace(DEFAULT_PREFIX, run_id))
    return found


def outcomes_from_etcd(endpoint: str, run_id: str) -> dict[int, dict]:
    """Round -> the leader's measured outcome of it (throughput before/after, measured and predicted gain)."""
    return {
        e.data["round"]: e.data
        for e in _events(endpoint, run_id)
        if e.kind == "outcome" and isinstance(e.data.get("round"), int)
    }


def decisions_from_etcd(endpoint: str, run_id: str) -> list[dict]:
    """The leader's decisions from the run's event log: round, members, reason, unix time."""
    return [
        {
            "round": e.data.get("round"),
            "members": e.data.get("members", []),
            "reason": e.data.get("reason", ""),
            "t": e.time,
        }
        for e in _events(endpoint, run_id)
        if e.kind == "decision"
    ]
