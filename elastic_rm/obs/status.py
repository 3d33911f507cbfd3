"""A job's state as stored in etcd, for `erm status`: round, members with resources and step times, leader,
decisions. Read-only; a malformed record is reported in ``errors`` and the rest is still shown."""

from __future__ import annotations

from typing import Any

from ..agent.metrics_record import parse_record
from ..etcd.client import EtcdClient
from ..rendezvous.keyspace import Keyspace
from ..rendezvous.records import NodeRecord, RecordError, RoundRecord


def list_runs(client: EtcdClient, prefix: str) -> list[str]:
    """Run ids that have a round under ``prefix``."""
    kvs, _ = client.get_prefix(prefix.rstrip("/") + "/")
    runs = set()
    for kv in kvs:
        parts = kv.key[len(prefix.rstrip("/")) + 1 :].split("/")
        if len(parts) == 2 and parts[1] == "round":
            runs.add(parts[0])
    return sorted(runs)


def job_status(client: EtcdClient, keys: Keyspace, decisions: int = 5) -> dict[str, Any]:
    kvs, revision = client.get_prefix(keys.run)
    errors: list[str] = []
    by_key = {kv.key: kv for kv in kvs}
    current = None
    if keys.round in by_key:
        try:
            current = RoundRecord.parse(keys.round, by_key[keys.round].value)
        except RecordError as exc:
            errors.append(str(exc))
    nodes: dict[str, dict[str, Any]] = {}
    for kv in kvs:
        if kv.key.startswith(keys.nodes):
            try:
                rec = NodeRecord.parse(kv.key, kv.value)
                nodes[rec.node] = {"node": rec.node, "host": rec.host, "state": rec.state, "nproc": rec.nproc}
            except RecordError as exc:
                errors.append(str(exc))
    for kv in kvs:
        if kv.key.startswith(keys.metrics):
            node = keys.node_of(kv.key)
            try:
                m = parse_record(kv.value, key=kv.key)
            except ValueError as exc:
                errors.append(str(exc))
                continue
            nodes.setdefault(node, {"node": node, "state": "gone"}).update(
                {
                    "cpu_util": m.cpu_util_last,
                    "mem_used_bytes": m.mem_used_bytes,
                    "mem_total_bytes": m.mem_total_bytes,
                    "gpus": len(m.gpus),
                    "step_p50_s": m.steps.p50_s if m.steps else None,
                    "step_p90_s": m.steps.p90_s if m.steps else None,
                    "samples_per_s": m.steps.samples_per_s if m.steps else None,
                }
            )
    records = []
    for kv in kvs:
        if kv.key.startswith(keys.rounds) and kv.key.endswith("/record"):
            try:
                r = RoundRecord.parse(kv.key, kv.value)
            except RecordError as exc:
                errors.append(str(exc))
                continue
            if r.complete or not r.members:
                records.append(r)
    records.sort(key=lambda r: r.round)
    members = list(current.members) if current else []
    leader = by_key[keys.leader].value.decode(errors="replace") if keys.leader in by_key else None
    return {
        "run": keys.run_id,
        "revision": revision,
        "round": current.round if current else None,
        "complete": current.complete if current else False,
        "world_size": len(members),
        "members": [{"rank": i, **nodes.get(n, {"node": n, "state": "gone"})} for i, n in enumerate(members)],
        "standby": [v for k, v in sorted(nodes.items()) if k not in members and v.get("state") != "gone"],
        "leader": leader,
        "closed": keys.closed in by_key,
        "decisions": [
            {
                "round": r.round,
                "members": list(r.members),
                "reason": r.reason,
                "predicted_gain": r.predicted_gain,
                "confidence": r.confidence,
                "time": r.time,
            }
            for r in records[-decisions:]
        ],
        "errors": errors,
    }
