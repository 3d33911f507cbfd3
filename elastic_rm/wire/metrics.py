"""The ``metrics/<node>`` etcd record: its format, encoding, strict parsing and the planner's view of it.

The agent builds it from its summaries (:mod:`elastic_rm.agent.record`).

One JSON object per node, rewritten at most once a second by the node's agent (the agent rate-limits;
this module only shapes the data)::

    {"v": 1, "node": "n1", "t": 1764495600.1,
     "cpu": {"util_mean": 0.41, "util_max": 0.52, "util_last": 0.40},
     "mem": {"used_bytes": 1, "available_bytes": 2, "total_bytes": 3},
     "workers": [{"pid": 123, "rss_bytes": 4, "cpu_util": 0.98}],
     "gpus": [{"index": 0, "util": 0.9, "mem_used_bytes": 5, "mem_total_bytes": 6, "temp_c": 61.0,
               "throttled": false, "throttle_reasons": []}],
     "steps": {"p50_s": 0.011, "p90_s": 0.013, "busy_p50_s": 0.008, "samples_per_s": 5800.0, "steps": 2700,
               "age_s": 0.2},
     "spares": {"count": 2, "rss_bytes": 7}}

``cpu.util_*`` are fractions of all the node's cores (0..1); a worker's ``cpu_util`` is in cores (1.0 = one
busy core, more for a multi-threaded worker). A GPU's ``util``/``temp_c`` are null where the device does not
report them; ``steps.busy_p50_s`` is the median busy time of a step (on CPU or runnable, not sleeping in a
collective: what tells a slow node in synchronous training; optional, absent from older agents);
``spares`` are the node's waiting warm spare workers (optional: absent with spares off and from older
agents); ``steps`` is null when no worker reported step times within the agent's window. Unknown keys
are ignored (a newer agent may add some); missing or mistyped known keys are an error naming the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..planner.interface import NodeMetrics, StepStats

RECORD_VERSION = 1


class MalformedMetricsError(ValueError):
    """A metrics record that does not follow the v1 schema; the message names the key and the field."""


@dataclass(frozen=True)
class WorkerRecord:
    pid: int
    rss_bytes: int
    cpu_util: float


@dataclass(frozen=True)
class GpuRecord:
    index: int
    util: float | None
    mem_used_bytes: int
    mem_total_bytes: int
    temp_c: float | None
    throttled: bool
    throttle_reasons: tuple[str, ...]


@dataclass(frozen=True)
class MetricsRecord:
    node: str
    t: float
    cpu_util_mean: float
    cpu_util_max: float
    cpu_util_last: float
    mem_used_bytes: int
    mem_available_bytes: int
    mem_total_bytes: int
    workers: tuple[WorkerRecord, ...]
    gpus: tuple[GpuRecord, ...]
    steps: StepStats | None  # the planner's own type: no second copy of the step summary
    steps_age_s: float | None = None  # seconds since the newest step report, when steps is known
    mem_node_bytes: int | None = None  # the node's own memory (its cgroup's, else agent + workers RSS)
    spares: int | None = None  # waiting warm spare workers (None: spares off, or an older agent)
    spares_rss_bytes: int | None = None  # their resident memory


def encode_record(record: dict[str, Any]) -> bytes:
    """Compact JSON bytes for etcd; NaN/inf are refused (JSON has none)."""
    return json.dumps(record, separators=(",", ":"), allow_nan=False).encode()


# ---- parse ---------------------------------------------------------------------------------------------
class _Reader:
    def __init__(self, key: str) -> None:
        self.where = f"metrics record {key!r}" if key else "metrics record"

    def fail(self, field: str, msg: str) -> MalformedMetricsError:
        return MalformedMetricsError(f"{self.where}: field {field!r} {msg}")

    def obj(self, parent: dict[str, Any], name: str, path: str) -> dict[str, Any]:
        if name not in parent:
            raise self.fail(path, "is missing")
        value = parent[name]
        if not isinstance(value, dict):
            raise self.fail(path, f"must be an object, got {type(value).__name__}")
        return value

    def num(
        self,
        parent: dict[str, Any],
        name: str,
        path: str,
        lo: float | None = 0.0,
        hi: float | None = None,
        nullable: bool = False,
    ) -> float | None:
        if name not in parent:
            raise self.fail(path, "is missing")
        value = parent[name]
        if value is None and nullable:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
            raise self.fail(path, f"must be a finite number, got {_short(value)}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            raise self.fail(
                path, f"must be within [{lo}, {hi if hi is not None else 'inf'}], got {_short(value)}"
            )
        return float(value)

    def int_(self, parent: dict[str, Any], name: str, path: str) -> int:
        if name not in parent:
            raise self.fail(path, "is missing")
        value = parent[name]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
            raise self.fail(path, f"must be an integer in [0, 2**63), got {_short(value)}")
        return value

    def list_(self, parent: dict[str, Any], name: str, path: str) -> list[Any]:
        if name not in parent:
            raise self.fail(path, "is missing")
        value = parent[name]
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list, got {type(value).__name__}")
        return value


def parse_record(data: bytes | str | dict[str, Any], key: str = "") -> MetricsRecord:
    """Validate a record (raw etcd bytes, JSON text or a decoded dict); raise
    :class:`MalformedMetricsError` naming ``key`` and the offending field, never anything else."""
    r = _Reader(key)
    if isinstance(data, bytes | str):
        try:
            doc = json.loads(data, parse_constant=_reject_constant)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise MalformedMetricsError(f"{r.where}: not valid JSON ({exc})") from None
    else:
        doc = data
    if not isinstance(doc, dict):
        raise MalformedMetricsError(f"{r.where}: must be a JSON object, got {type(doc).__name__}")
    v = doc.get("v")
    if isinstance(v, bool) or not isinstance(v, int) or v != RECORD_VERSION:
        raise r.fail("v", f"must be {RECORD_VERSION} (this elastic-rm reads v1 records), got {_short(v)}")
    node = doc.get("node")
    if not isinstance(node, str) or not node:
        raise r.fail("node", f"must be a non-empty string, got {_short(node)}")
    t = r.num(doc, "t", "t")
    cpu = r.obj(doc, "cpu", "cpu")
    mem = r.obj(doc, "mem", "mem")
    workers = []
    for i, w in enumerate(r.list_(doc, "workers", "workers")):
        p = f"workers[{i}]"
        if not isinstance(w, dict):
            raise r.fail(p, f"must be an object, got {type(w).__name__}")
        workers.append(
            WorkerRecord(
                pid=r.int_(w, "pid", f"{p}.pid"),
                rss_bytes=r.int_(w, "rss_bytes", f"{p}.rss_bytes"),
                cpu_util=r.num(w, "cpu_util", f"{p}.cpu_util"),  # type: ignore[arg-type]
            )
        )
    gpus = []
    for i, g in enumerate(r.list_(doc, "gpus", "gpus")):
        p = f"gpus[{i}]"
        if not isinstance(g, dict):
            raise r.fail(p, f"must be an object, got {type(g).__name__}")
        throttled = g.get("throttled")
        if not isinstance(throttled, bool):
            raise r.fail(f"{p}.throttled", f"must be true or false, got {_short(throttled)}")
        reasons = r.list_(g, "throttle_reasons", f"{p}.throttle_reasons")
        if not all(isinstance(x, str) for x in reasons):
            raise r.fail(f"{p}.throttle_reasons", f"must be a list of strings, got {_short(reasons)}")
        gpus.append(
            GpuRecord(
                index=r.int_(g, "index", f"{p}.index"),
                util=r.num(g, "util", f"{p}.util", hi=1.0, nullable=True),
                mem_used_bytes=r.int_(g, "mem_used_bytes", f"{p}.mem_used_bytes"),
                mem_total_bytes=r.int_(g, "mem_total_bytes", f"{p}.mem_total_bytes"),
                temp_c=r.num(g, "temp_c", f"{p}.temp_c", lo=None, nullable=True),
                throttled=throttled,
                throttle_reasons=tuple(reasons),
            )
        )
    if "steps" not in doc:
        raise r.fail("steps", "is missing (null when no step times are known)")
    steps, steps_age_s = None, None
    if doc["steps"] is not None:
        s = r.obj(doc, "steps", "steps")
        steps_age_s = r.num(s, "age_s", "steps.age_s")
        steps = StepStats(
            p50_s=r.num(s, "p50_s", "steps.p50_s"),  # type: ignore[arg-type]
            p90_s=r.num(s, "p90_s", "steps.p90_s"),  # type: ignore[arg-type]
            samples_per_s=r.num(s, "samples_per_s", "steps.samples_per_s"),  # type: ignore[arg-type]
            steps=r.int_(s, "steps", "steps.steps"),
            busy_p50_s=r.num(s, "busy_p50_s", "steps.busy_p50_s") if "busy_p50_s" in s else None,
        )
    spares, spares_rss = None, None
    if doc.get("spares") is not None:
        sp = r.obj(doc, "spares", "spares")
        spares, spares_rss = r.int_(sp, "count", "spares.count"), r.int_(sp, "rss_bytes", "spares.rss_bytes")
    return MetricsRecord(
        node=node,
        t=t,  # type: ignore[arg-type]
        cpu_util_mean=r.num(cpu, "util_mean", "cpu.util_mean", hi=1.0),  # type: ignore[arg-type]
        cpu_util_max=r.num(cpu, "util_max", "cpu.util_max", hi=1.0),  # type: ignore[arg-type]
        cpu_util_last=r.num(cpu, "util_last", "cpu.util_last", hi=1.0),  # type: ignore[arg-type]
        mem_used_bytes=r.int_(mem, "used_bytes", "mem.used_bytes"),
        mem_available_bytes=r.int_(mem, "available_bytes", "mem.available_bytes"),
        mem_total_bytes=r.int_(mem, "total_bytes", "mem.total_bytes"),
        workers=tuple(workers),
        gpus=tuple(gpus),
        steps=steps,
        steps_age_s=steps_age_s,  # type: ignore[arg-type]
        mem_node_bytes=None if mem.get("node_bytes") is None else r.int_(mem, "node_bytes", "mem.node_bytes"),
        spares=spares,
        spares_rss_bytes=spares_rss,
    )


def finite(value: float) -> bool:
    """math.isfinite, and False for an integer too large for a float (json.loads reads one; isfinite
    raises OverflowError on it). For every reader of numbers in wire's records; the planner, below
    which wire may not reach, has its twin in planner/job.py."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


# ---- planner view --------------------------------------------------------------------------------------
def to_node_metrics(record: MetricsRecord) -> NodeMetrics:
    """The planner's view. A GPU whose utilisation is unknown (null: a MIG slice) counts as 0.0 and is
    marked in ``gpu_util_known``, which the planner reads to leave it out of its GPU comparison: without
    the mark a node whose GPUs do not report utilisation looked idle and was replaced as a straggler at
    the same step time as the others."""
    return NodeMetrics(
        cpu_util=record.cpu_util_mean,
        mem_used_bytes=record.mem_used_bytes,
        mem_available_bytes=record.mem_available_bytes,
        mem_total_bytes=record.mem_total_bytes,
        gpu_util=tuple(g.util if g.util is not None else 0.0 for g in record.gpus),
        gpu_util_known=tuple(g.util is not None for g in record.gpus),
        gpu_mem_used_bytes=tuple(g.mem_used_bytes for g in record.gpus),
        gpu_throttled=any(g.throttled for g in record.gpus),
        steps=record.steps,
    )
