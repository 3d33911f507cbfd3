"""A job's state as stored in etcd, for `erm status` and `erm top`: round, members with resources and step
times, leader, decisions with predicted and measured gain, recent events. Read-only; a malformed record or
event is reported in ``errors`` and the rest is still shown.

The measured gain of a decision has one definition: the leader's ``rounds/<n>/outcome`` record (the
job's samples/s once the round ran a full step window, over the samples/s before the decision), read here
as written; `erm report` and `erm demo` read the same record.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Iterable
from typing import Any

from ..etcd.client import EtcdClient, KeyValue
from ..wire.keyspace import Keyspace
from ..wire.metrics import parse_record
from ..wire.records import (
    QUEUE_STALE_AFTER_S,
    LedgerRecord,
    NodeRecord,
    QueueRecord,
    RecordError,
    RoundRecord,
    effective_rounds,
)
from .events import PERIODIC_KINDS, Event, EventError, sane_time
from .restores import round_restores, with_restores

RECENT_EVENTS = 8
MEASURED_HOW = (
    "measured = the leader's outcome record of the round: the job's samples/s once the round ran a full "
    "step window over the samples/s before the decision; error = predicted - measured"
)


def list_runs(client: EtcdClient, prefix: str) -> list[str]:
    """Run ids that have a round, a leader or a registered node under ``prefix``: a run still forming its
    first round (its nodes wait for --nnodes MIN) has no round key yet, and is the run `erm status` means."""
    kvs, _ = client.get_prefix(prefix.rstrip("/") + "/")
    runs = set()
    for kv in kvs:
        parts = kv.key[len(prefix.rstrip("/")) + 1 :].split("/")
        if len(parts) == 2 and parts[1] in ("round", "leader"):
            runs.add(parts[0])
        elif len(parts) == 3 and parts[1] == "nodes" and parts[0] != "history":  # not history/<sig>/<run>
            runs.add(parts[0])
    return sorted(runs)


def job_status(
    client: EtcdClient, keys: Keyspace, decisions: int = 5, all_events: bool = False
) -> dict[str, Any]:
    kvs, revision = client.get_prefix(keys.run)
    return status_from_kvs(keys, kvs, revision, decisions, all_events)


def round_throughput(samples: Iterable[Event]) -> dict[int, float]:
    """Samples/s of each round: per node the median of the later half of its samples in the round (the
    agent's step-time window still holds the previous round's steps early on), summed over nodes."""
    per: dict[int, dict[str, list[float]]] = {}
    for e in samples:
        r, rate = e.data.get("round"), e.data.get("samples_per_s")
        if isinstance(r, int) and isinstance(rate, (int, float)) and not isinstance(rate, bool):
            per.setdefault(r, {}).setdefault(e.node, []).append(float(rate))
    return {r: sum(statistics.median(v[len(v) // 2 :]) for v in nodes.values()) for r, nodes in per.items()}


OUTCOME_NUMBERS = (  # an outcome's numeric fields: each a number or null (absent: null)
    "throughput_before",
    "throughput_after",
    "measured_gain",
    "predicted_gain",
    "prediction_error",
)


def is_number(x: object) -> bool:
    """A finite int or float, not a bool: what a record's numeric field must hold."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def outcome_problem(d: object) -> str | None:
    """Why ``d`` is not an outcome record as the leader writes it (None: it is): an object with an integer
    ``round``, each of OUTCOME_NUMBERS a finite number or null, and a measured gain only with both
    throughputs it was measured from. Readers show a malformed outcome as such, and leave it out."""
    if not isinstance(d, dict) or not isinstance(d.get("round"), int) or isinstance(d["round"], bool):
        return "expected an object with an integer 'round'"
    for name in OUTCOME_NUMBERS:
        if d.get(name) is not None and not is_number(d[name]):
            return f"field {name!r} must be a number or null, got {d[name]!r:.40}"
    if d.get("measured_gain") is not None and (
        d.get("throughput_before") is None or d.get("throughput_after") is None
    ):
        return "a 'measured_gain' without the 'throughput_before' and 'throughput_after' it was measured from"
    return None


def outcomes_from_kvs(kvs: Iterable[KeyValue], errors: list[str]) -> dict[int, dict[str, Any]]:
    """Round -> the leader's outcome record (``rounds/<n>/outcome``) among ``kvs``; malformed ones are
    reported in ``errors`` and left out."""
    out: dict[int, dict[str, Any]] = {}
    for kv in kvs:
        if "/rounds/" in kv.key and kv.key.endswith("/outcome"):
            try:
                d = json.loads(kv.value)
            except (ValueError, RecursionError):
                errors.append(f"etcd key {kv.key}: not JSON")
                continue
            problem = outcome_problem(d)
            if problem is None:
                out[d["round"]] = d
            else:
                errors.append(f"etcd key {kv.key}: {problem}")
    return out


def decided_rounds(kvs: list[KeyValue], errors: list[str]) -> list[RoundRecord]:
    """:func:`effective_rounds`, less the records whose ``time`` no reader can format (1e300: see
    elastic_rm.obs.events.MAX_TIME), which are reported in ``errors`` as malformed."""
    records = effective_rounds(kvs, errors)
    bad = [r for r in records if not sane_time(r.time)]
    if not bad:
        return records
    keys = {}
    for kv in kvs:
        parts = kv.key.rsplit("/", 2)
        if kv.key.endswith("/record") and "/rounds/" in kv.key and parts[-2].isdigit():
            keys[int(parts[-2])] = kv.key
    for r in bad:
        errors.append(
            f"malformed value in etcd key {keys.get(r.round, f'of round {r.round}')}: field 'time' must be "
            f"unix seconds from 1970 to 9999, got {r.time!r}"
        )
    return [r for r in records if sane_time(r.time)]


def prediction_error(outcome: dict[str, Any]) -> float | None:
    """Predicted minus measured gain (None when either is missing); older records lack the field."""
    err = outcome.get("prediction_error")
    if isinstance(err, (int, float)):
        return float(err)
    p, m = outcome.get("predicted_gain"), outcome.get("measured_gain")
    return p - m if isinstance(p, (int, float)) and isinstance(m, (int, float)) else None


def decision_rows(
    records: Iterable[RoundRecord], outcomes: dict[int, dict[str, Any]]
) -> list[dict[str, Any]]:
    rows, previous = [], None
    for r in records:
        o = outcomes.get(r.round, {})
        rows.append(
            {
                "round": r.round,
                "members": list(r.members),
                "standby": list(r.standby),
                "reason": r.reason,
                "predicted_gain": r.predicted_gain,
                "confidence": r.confidence,
                "time": r.time,
                "measured_gain": o.get("measured_gain"),
                "throughput_after": o.get("throughput_after"),
                "throughput_before": o.get("throughput_before"),
                "compared_to_round": previous if o else None,
                "prediction_error": prediction_error(o) if o else None,
            }
        )
        previous = r.round
    return rows


def parse_events(keys: Keyspace, kvs: Iterable[KeyValue], errors: list[str]) -> list[Event]:
    events = []
    for kv in kvs:
        if kv.key.startswith(keys.events):
            try:
                events.append(Event.parse(f"etcd key {kv.key}", kv.value))
            except EventError as exc:
                errors.append(str(exc))
    events.sort(key=lambda e: e.time)
    return events


def queue_view(record: QueueRecord, now: float | None = None) -> dict[str, Any]:
    """The queue key as `erm status` shows it: the count written, how old it is (``now`` minus the
    writer's time: this machine's clock against the writer's), and whether it is older than the bound past
    which the leader counts it as unknown (the leader measures that bound on its own clock, from when it
    first read the value)."""
    now = time.time() if now is None else now
    age = max(0.0, now - record.time) if record.time > 0 else None
    return {
        "waiting_nodes": record.waiting_nodes,
        "age_s": None if age is None else round(age, 1),
        "unknown": age is not None and age > QUEUE_STALE_AFTER_S,
        "stale_after_s": QUEUE_STALE_AFTER_S,
        "source": record.source,
    }


def status_from_kvs(
    keys: Keyspace,
    kvs: list[KeyValue],
    revision: int,
    decisions: int = 5,
    all_events: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """The status from the run's keys as read (``erm status``) or kept current by a watch (``erm top``);
    ``now``: this machine's time (the queue key's age)."""
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
                    "mem_node_bytes": m.mem_node_bytes,
                    "mem_total_bytes": m.mem_total_bytes,
                    "gpus": len(m.gpus),
                    "gpu_util": [g.util for g in m.gpus],
                    "step_p50_s": m.steps.p50_s if m.steps else None,
                    "step_p90_s": m.steps.p90_s if m.steps else None,
                    "samples_per_s": m.steps.samples_per_s if m.steps else None,
                    "spares": m.spares,
                    "spares_rss_bytes": m.spares_rss_bytes,
                }
            )
    data = None
    if keys.ledger in by_key:
        try:
            led = LedgerRecord.parse(keys.ledger, by_key[keys.ledger].value)
            data = {
                "step": led.step,
                "epoch": led.epoch,
                "samples_done": led.samples_done,
                "epoch_samples": led.epoch_samples,
                "by": led.node,
                "time": led.time,
            }
        except RecordError as exc:
            errors.append(str(exc))
    queue = None  # the cluster's queue as the executor wrote it (None: no executor knows it)
    if keys.queue in by_key:
        try:
            queue = queue_view(QueueRecord.parse(keys.queue, by_key[keys.queue].value), now)
        except RecordError as exc:
            errors.append(str(exc))
    records = decided_rounds([kv for kv in kvs if kv.key.startswith(keys.rounds)], errors)
    events = parse_events(keys, kvs, errors)
    outcomes = outcomes_from_kvs(kvs, errors)
    members = list(current.members) if current else []
    leader = by_key[keys.leader].value.decode(errors="replace") if keys.leader in by_key else None
    rates = [nodes.get(n, {}).get("samples_per_s") for n in members]
    rows = decision_rows(records, outcomes)  # all: each compared to the round before it
    return {
        "run": keys.run_id,
        "revision": revision,
        "round": current.round if current else None,
        "sealed": current.sealed if current else False,
        "world_size": len(members),
        "members": [{"rank": i, **nodes.get(n, {"node": n, "state": "gone"})} for i, n in enumerate(members)],
        "standby": [v for k, v in sorted(nodes.items()) if k not in members and v.get("state") != "gone"],
        "leader": leader,
        "closed": keys.closed in by_key,
        "samples_per_s": sum(r for r in rates if r is not None)
        if any(r is not None for r in rates)
        else None,
        # as the leader counts it: None without a queue key, or with one too old to trust
        "waiting_nodes": queue["waiting_nodes"] if queue is not None and not queue["unknown"] else None,
        "queue": queue,
        "data": data,  # the sample ledger as of the newest checkpoint (None: no ledger mirrored)
        # with each round's restore: downtime and steps trained again (the agents' "restore" events)
        "decisions": with_restores(rows[max(0, len(rows) - max(0, decisions)) :], round_restores(events)),
        "measured_how": MEASURED_HOW,
        "events": [
            {"time": e.time, "node": e.node, "kind": e.kind, "message": e.message}
            for e in [e for e in events if all_events or e.kind not in PERIODIC_KINDS][-RECENT_EVENTS:]
        ],
        "errors": errors,
    }
