"""JobSpec: what the planner knows about a job before it runs (``snapshot.job``), and its signature.

The job dict is JSON-like so that it can travel through etcd and ``erm plan``; :func:`parse_job` checks it
and names the field at fault (``JobSpecError``), never guesses.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from dataclasses import dataclass

DEFAULT_BANDWIDTH = 1.25e9  # bytes/s, 10 GbE: assumed when the job does not say


class JobSpecError(ValueError):
    """A job description is malformed; the message names the field."""


@dataclass(frozen=True)
class Table:
    rows: int
    dim: int


@dataclass(frozen=True)
class Request:
    """What the user asked for, per node."""

    nodes: int
    cpu_per_node: float
    mem_per_node_bytes: int
    gpus_per_node: int = 0


@dataclass(frozen=True)
class JobSpec:
    name: str
    global_batch: int
    tables: tuple[Table, ...]
    dense_params: int
    bandwidth: float = DEFAULT_BANDWIDTH  # bytes/s between nodes (measured when known)
    bytes_per_param: int = 4
    optimizer_state_factor: float = 1.0  # optimizer bytes per parameter byte (Adagrad 1, Adam 2)
    lookups_per_sample: float = 1.0  # pooled lookups per table per sample
    request: Request | None = None

    @property
    def table_bytes(self) -> int:
        return sum(t.rows * t.dim for t in self.tables) * self.bytes_per_param

    @property
    def emb_bytes_per_sample(self) -> float:
        """Pooled embedding bytes one sample sends through the all-to-all."""
        return sum(t.dim for t in self.tables) * self.bytes_per_param * self.lookups_per_sample

    @property
    def dense_bytes(self) -> int:
        return self.dense_params * self.bytes_per_param

    def signature(self) -> str:
        """Stable id of "the same job": name, table shapes, dense size, batch (not the resources)."""
        key = {
            "name": self.name,
            "batch": self.global_batch,
            "tables": sorted([t.rows, t.dim] for t in self.tables),
            "dense": self.dense_params,
        }
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        return f"{_slug(self.name)}-{digest}"


def _slug(name: str) -> str:
    s = "".join(c if c.isalnum() or c in "-_" else "-" for c in name.lower()).strip("-")
    return s[:40] or "job"


LARGEST = 1e18  # of any number in a job description: far past a real job's, and the memory model's products
# of such numbers (rows x dim x bytes x optimizer factor) stay finite floats. A 400-digit integer passed
# the finite check and made float() overflow there (a traceback from `erm plan`, a crashed simulation)


def _num(d: dict, key: str, where: str, kind: type = float, minimum: float = 0.0, default=None):
    if key not in d:
        if default is not None:
            return default
        raise JobSpecError(f"{where}: missing field '{key}'")
    v = d[key]
    # finite, and within a float: json.load reads NaN and Infinity (NaN >= minimum is False, so a NaN
    # bandwidth reached the model) and 400-digit integers (float() of those raised OverflowError)
    if isinstance(v, int | float) and not isinstance(v, bool) and not finite(v):
        raise JobSpecError(f"{where}: field '{key}' must be a finite number, got {str(v)[:40]}")
    if isinstance(v, bool) or not isinstance(v, int | float) or (kind is int and not float(v).is_integer()):
        raise JobSpecError(
            f"{where}: field '{key}' must be {'an integer' if kind is int else 'a number'}, got {v!r}"
        )
    if v < minimum:
        raise JobSpecError(f"{where}: field '{key}' must be >= {minimum}, got {v!r}")
    if v > LARGEST:
        raise JobSpecError(f"{where}: field '{key}' must be <= {LARGEST:g}, got {str(v)[:40]}")
    return kind(v)


def finite(v: float) -> bool:
    """math.isfinite, and False for an integer too large for a float (json.loads reads one; isfinite
    raises OverflowError on it). For the planner's readers of numbers from JSON; wire, which may not
    import this module, has its twin in wire/metrics.py."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


FIELDS = frozenset(
    {"name", "tables", "request", "global_batch", "dense_params", "bandwidth", "bytes_per_param"}
    | {"optimizer_state_factor", "lookups_per_sample", "planner", "oom_count"}
)
TABLE_FIELDS = frozenset({"rows", "dim"})
REQUEST_FIELDS = frozenset({"nodes", "cpu_per_node", "mem_per_node_bytes", "gpus_per_node"})


def reject_unknown(
    d: dict, known: frozenset[str], where: str, error: type[ValueError] = ValueError, noun: str = "field"
) -> None:
    """A field nobody reads is a typo until proven otherwise: fail, naming the closest known field."""
    for key in sorted(set(d) - known, key=str):
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f" (known: {', '.join(sorted(known))})"
        raise error(f"{where}: unknown {noun} {key!r}{hint}")


def parse_job(d: object, where: str = "job", also: frozenset[str] = frozenset()) -> JobSpec:
    """Validate a job dict (schema in docs/planner.md) and build the JobSpec. Unknown fields are errors;
    ``also`` names the fields a caller reads itself (`erm plan`'s observations, say)."""
    if not isinstance(d, dict):
        raise JobSpecError(f"{where}: expected a JSON object, got {type(d).__name__}")
    reject_unknown(d, FIELDS | also, where, JobSpecError)
    name = d.get("name", "job")
    if not isinstance(name, str):
        raise JobSpecError(f"{where}: field 'name' must be a string")
    tables_raw = d.get("tables")
    if not isinstance(tables_raw, list) or not tables_raw:
        raise JobSpecError(f"{where}: field 'tables' must be a non-empty list of {{rows, dim}}")
    tables = []
    for i, t in enumerate(tables_raw):
        if not isinstance(t, dict):
            raise JobSpecError(f"{where}: tables[{i}] must be an object")
        reject_unknown(t, TABLE_FIELDS, f"{where}.tables[{i}]", JobSpecError)
        tables.append(
            Table(
                _num(t, "rows", f"{where}.tables[{i}]", int, 1),
                _num(t, "dim", f"{where}.tables[{i}]", int, 1),
            )
        )
    request = None
    if "request" in d:
        r = d["request"]
        if not isinstance(r, dict):
            raise JobSpecError(f"{where}: field 'request' must be an object")
        w = f"{where}.request"
        reject_unknown(r, REQUEST_FIELDS, w, JobSpecError)
        request = Request(
            nodes=_num(r, "nodes", w, int, 1),
            cpu_per_node=_num(r, "cpu_per_node", w, float, 0.0, default=0.0),
            mem_per_node_bytes=_num(r, "mem_per_node_bytes", w, int, 0, default=0),
            gpus_per_node=_num(r, "gpus_per_node", w, int, 0, default=0),
        )
    # read by the leader's memory rules: int() of a string or NaN there crashed the leader
    if d.get("oom_count") is not None:
        _num(d, "oom_count", where, int, 0)
    return JobSpec(
        name=name,
        global_batch=_num(d, "global_batch", where, int, 1),
        tables=tuple(tables),
        dense_params=_num(d, "dense_params", where, int, 0),
        bandwidth=_num(d, "bandwidth", where, float, 1.0, default=DEFAULT_BANDWIDTH),
        bytes_per_param=_num(d, "bytes_per_param", where, int, 1, default=4),
        optimizer_state_factor=_num(d, "optimizer_state_factor", where, float, 0.0, default=1.0),
        lookups_per_sample=_num(d, "lookups_per_sample", where, float, 0.0, default=1.0),
        request=request,
    )
