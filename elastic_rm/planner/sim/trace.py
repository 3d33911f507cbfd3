"""The job trace: one CSV row per job, what the user asked for and the job's hidden ground truth.

Columns (README: docs/planner.md, "Trace schema"); ``known`` ones reach the planner through the job
description, ``truth`` ones only the simulator. A malformed file is a :class:`TraceError` that names the
file, the line and the field.
"""

from __future__ import annotations

import csv
import difflib
from dataclasses import MISSING, asdict, dataclass, fields

from ..job import JobSpecError, finite, parse_job

GIB = 1024**3


class TraceError(ValueError):
    """A trace file is malformed; the message names file, line and field."""


@dataclass(frozen=True)
class TraceJob:
    # --- what the user submits (known) ---
    job_id: str
    submit_s: float
    name: str  # recurring runs of one job share the name and the shapes
    global_batch: int
    n_tables: int
    rows_per_table: int
    dim: int
    dense_params: int
    opt_factor: float  # optimizer bytes per parameter byte
    bandwidth: float  # bytes/s between nodes
    gpus_per_node: int
    req_nodes: int
    req_min_nodes: int
    req_max_nodes: int
    req_cpu_per_node: float
    req_mem_gib_per_node: float
    # --- ground truth (hidden from the policies) ---
    work_samples: float  # samples to train
    t_compute: float  # seconds per sample per GPU
    t_a2a_eff: float  # all-to-all time / wire time
    t_ar_eff: float  # all-reduce time / wire time
    t_fixed_s: float
    t_latency_s: float  # per log2(world) collective stage
    cpu_base: float  # cores per node when idle-ish
    cpu_per_sample: float  # core-seconds of input pipeline per sample
    mem_overhead_gib: float
    mem_table_factor: float  # real table bytes / declared (hash slack, fragmentation)
    act_bytes_per_sample: float
    mem_growth_frac: float  # tables grow by this fraction of their start size over the whole run
    error_at_frac: float  # 0: none; else the job fails with a non-resource error at this fraction of work
    # --- ground truth of the users who hurt (optional columns; the defaults are the plain generator's) ---
    step_cv: float = 0.03  # lognormal sigma of the job's step time from one sample to the next
    warmup_s: float = 0.0  # every round runs at half speed for this long after it starts
    skew_at_frac: float = 0.0  # 0: none; else the compute time per sample changes here (data skew)
    skew_factor: float = 1.0  # by this factor
    worker_noise: int = 0  # 1: every member's step time varies as a PAI worker's did (worker_noise.py)

    def job_dict(self) -> dict:
        """The job description the planner sees (schema: docs/planner.md)."""
        return {
            "name": self.name,
            "global_batch": self.global_batch,
            "tables": [{"rows": self.rows_per_table, "dim": self.dim}] * self.n_tables,
            "dense_params": self.dense_params,
            "bandwidth": self.bandwidth,
            "optimizer_state_factor": self.opt_factor,
            "request": {
                "nodes": self.req_nodes,
                "cpu_per_node": self.req_cpu_per_node,
                "mem_per_node_bytes": int(self.req_mem_gib_per_node * GIB),
                "gpus_per_node": self.gpus_per_node,
            },
        }


FIELDS = tuple(f.name for f in fields(TraceJob))
_TYPES = {f.name: f.type for f in fields(TraceJob)}
_POSITIVE = {"global_batch", "n_tables", "rows_per_table", "dim", "bandwidth", "gpus_per_node", "req_nodes"}
_POSITIVE |= {"req_min_nodes", "req_max_nodes", "req_cpu_per_node", "req_mem_gib_per_node", "work_samples"}
_POSITIVE |= {"t_compute", "mem_table_factor", "skew_factor"}
OPTIONAL = {f.name for f in fields(TraceJob) if f.default is not MISSING}  # older traces lack them


def _parse(path: str, line: int, key: str, raw: str | None):
    kind = _TYPES[key]
    where = f"{path}:{line}: field '{key}'"
    if raw is None or raw.strip() == "":
        raise TraceError(f"{where}: empty")
    if kind == "str":
        return raw
    try:
        v = int(raw) if kind == "int" else float(raw)
    except ValueError:
        raise TraceError(
            f"{where}: expected {'an integer' if kind == 'int' else 'a number'}, got {raw!r}"
        ) from None
    # finite() and not math.isfinite(): a 400-digit integer made isfinite raise OverflowError
    if not finite(v) or v < 0 or (key in _POSITIVE and v <= 0):
        raise TraceError(f"{where}: must be {'> 0' if key in _POSITIVE else '>= 0'}, got {raw!r}")
    return v


def load_trace(path: str) -> list[TraceJob]:
    try:
        f = open(path, newline="", encoding="utf-8-sig")  # a spreadsheet's byte order mark is no column
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror}") from None
    with f:
        try:
            return _read(path, csv.DictReader(f))
        except UnicodeDecodeError:
            raise TraceError(f"{path}: not UTF-8 text") from None
        except csv.Error as exc:
            raise TraceError(f"{path}: not a CSV file: {exc}") from None


def _read(path: str, reader: csv.DictReader) -> list[TraceJob]:
    missing = [k for k in FIELDS if k not in (reader.fieldnames or []) and k not in OPTIONAL]
    if missing:
        raise TraceError(f"{path}:1: missing column(s) {', '.join(missing)}")
    for i, name in enumerate(reader.fieldnames or []):  # a misspelt optional column silently kept its default
        if name in (reader.fieldnames or [])[:i]:  # csv.DictReader kept the last one's values, silently
            raise TraceError(f"{path}:1: column {name!r} appears twice")
        if name not in _TYPES:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise TraceError(f"{path}:1: unknown column {name!r}{hint}")
    jobs, ids = [], set()
    for row in reader:
        line = reader.line_num
        if None in row:
            raise TraceError(f"{path}:{line}: more values than columns")
        job = TraceJob(**{k: _parse(path, line, k, row.get(k)) for k in FIELDS if k in row})
        if not job.req_min_nodes <= job.req_nodes <= job.req_max_nodes:
            raise TraceError(
                f"{path}:{line}: field 'req_nodes': need req_min_nodes <= req_nodes <= req_max_nodes"
            )
        if job.skew_at_frac >= 1 or job.worker_noise not in (0, 1):
            what = "skew_at_frac" if job.skew_at_frac >= 1 else "worker_noise"
            raise TraceError(
                f"{path}:{line}: field '{what}': must be {'< 1' if what[0] == 's' else '0 or 1'}"
            )
        if job.error_at_frac >= 1:
            raise TraceError(f"{path}:{line}: field 'error_at_frac': must be < 1")
        try:  # the job description the policies get: the planner refuses what parse_job refuses (bandwidth
            # < 1 B/s, 1e300 GiB of memory), and that refusal was a traceback minutes into the simulation
            parse_job(job.job_dict(), where=f"{path}:{line}: job description")
        except JobSpecError as exc:
            raise TraceError(str(exc)) from None
        except OverflowError:  # job_dict's int(req_mem_gib_per_node * GIB), its one conversion to int
            raise TraceError(f"{path}:{line}: field 'req_mem_gib_per_node': too large") from None
        if job.job_id in ids:
            raise TraceError(f"{path}:{line}: field 'job_id': duplicate {job.job_id!r}")
        ids.add(job.job_id)
        jobs.append(job)
    if not jobs:
        raise TraceError(f"{path}: no jobs")
    return sorted(jobs, key=lambda j: (j.submit_s, j.job_id))


def write_trace(path: str, jobs: list[TraceJob]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for j in jobs:
            row = asdict(j)
            w.writerow({k: (f"{v:.10g}" if isinstance(v, float) else v) for k, v in row.items()})
