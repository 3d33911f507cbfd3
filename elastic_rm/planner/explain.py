"""What the planner would do for a job description, and why (``erm plan``): pure, returns data + text.

Input (JSON, schema in docs/planner.md): the job description (as in ``snapshot.job``) plus optional
``min_nodes``, ``max_nodes``, ``history`` (records, ``"v": 1``) and ``observations`` of a running job
(``[{"world": 4, "step_s": 0.21, "capacity": 1}]``).
"""

from __future__ import annotations

from .config import PlannerConfig
from .history import RECORD_FIELDS, HistoryError, parse_record, warm_start
from .job import JobSpecError, parse_job, reject_unknown
from .memory_model import estimate_node_memory
from .perf_model import Sample
from .scaling import choose_world, fit_configs, shape_of

GIB = 1024**3
PLAN_FIELDS = frozenset({"min_nodes", "max_nodes", "history", "observations"})  # erm plan reads these
OBSERVATION_FIELDS = frozenset({"world", "step_s", "capacity"})


def explain(desc: object, cfg: PlannerConfig | None = None, where: str = "job") -> dict:
    """Stage 1 (always), the memory model at the start size, stage 2 when observations are given."""
    cfg = cfg or PlannerConfig()
    job = parse_job(desc, where, also=PLAN_FIELDS)
    assert isinstance(desc, dict)
    req = job.request
    lo = _int(desc, "min_nodes", where, 1)
    hi = _int(desc, "max_nodes", where, max(req.nodes if req else 1, lo) * 2)
    if hi < lo:
        raise JobSpecError(f"{where}: field 'max_nodes' ({hi}) is below 'min_nodes' ({lo})")
    raw_hist = desc.get("history", [])
    if not isinstance(raw_hist, list):
        raise JobSpecError(f"{where}: field 'history' must be a list of records")
    try:
        records = []
        for i, r in enumerate(raw_hist):
            if isinstance(r, dict):  # a misspelt optional field ("coeff") silently kept its default
                reject_unknown(r, RECORD_FIELDS, f"{where}.history[{i}]", JobSpecError)
            records.append(parse_record(r, f"{where}.history[{i}]"))
    except HistoryError as exc:
        raise JobSpecError(str(exc)) from None
    # stage 1 reads only this job's records: another job's (renamed, a new batch) was a silent cold start
    for i, r in enumerate(records):
        if r.signature != job.signature():
            raise JobSpecError(
                f"{where}.history[{i}]: field 'signature' is {r.signature!r}, not this job's "
                f"{job.signature()!r} (name, global_batch, table shapes and dense_params make it)"
            )
    start = warm_start(job, records, lo, hi, cfg)
    mem = estimate_node_memory(job, start.world, cfg.cold_overhead_bytes)
    out: dict = {
        "signature": job.signature(),
        "min_nodes": lo,
        "max_nodes": hi,
        "stage1": {
            "world": start.world,
            "mem_per_node_gib": start.mem_per_node_bytes / GIB,
            "cpu_per_node": start.cpu_per_node or None,
            "reason": start.reason,
            "confidence": start.confidence,
            "history_records": start.from_history,
        },
        "memory_model_gib": {
            "tables": mem.tables / GIB,
            "optimizer": mem.optimizer / GIB,
            "dense": mem.dense / GIB,
            "activations": mem.activations / GIB,
            "overhead": mem.overhead / GIB,
            "total": mem.total / GIB,
        },
    }
    if req:
        out["request"] = {
            "nodes": req.nodes,
            "mem_per_node_gib": req.mem_per_node_bytes / GIB,
            "cpu_per_node": req.cpu_per_node,
        }
    obs = desc.get("observations", [])
    if not isinstance(obs, list):
        raise JobSpecError(f"{where}: field 'observations' must be a list")
    samples = []
    for i, o in enumerate(obs):
        w = f"{where}.observations[{i}]"
        if not isinstance(o, dict):
            raise JobSpecError(f"{w}: expected an object")
        reject_unknown(o, OBSERVATION_FIELDS, w, JobSpecError)  # "capcity" silently planned with capacity 1
        samples.append(
            Sample(_int(o, "world", w, None), _num(o, "capacity", w, 1.0), _num(o, "step_s", w, None))
        )
    if samples:
        f = fit_configs(job, samples, start.coef)
        cap = samples[-1].capacity
        cur = samples[-1].world
        t = choose_world(f, job, cap, cur, lo, hi, cfg)
        shape = shape_of(job)
        out["stage2"] = {
            "coefficients": dict(zip(("compute", "all_to_all", "all_reduce", "fixed"), f.coef, strict=True)),
            "r2": f.r2,
            "rel_rmse": f.rel_rmse,
            "current_world": cur,
            "target_world": t.world,
            "why": t.why,
            "predicted_gain": t.throughput / t.current_throughput - 1,
            "confidence": t.confidence,
            "throughput": {w: f.band(shape, w, cap) for w in range(lo, hi + 1)},
        }
    return out


def _int(d: dict, key: str, where: str, default: int | None) -> int:
    v = d.get(key, default)
    if v is None:
        raise JobSpecError(f"{where}: missing field '{key}'")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise JobSpecError(f"{where}: field '{key}' must be an integer >= 1, got {v!r}")
    return v


OBSERVED = (1e-9, 1e9)  # a step time (s) or a capacity past these is no measurement: a step of 1e299 s
# overflowed the model fit's squares (a traceback), one of 1e-300 s a throughput of 1e300 samples/s


def _num(d: dict, key: str, where: str, default: float | None) -> float:
    v = d.get(key, default)
    if v is None:
        raise JobSpecError(f"{where}: missing field '{key}'")
    # finite too: NaN <= 0 is False, so a NaN step time made a plan of NaN ("4 -> 1 node(s)"), and
    # float() of a 400-digit integer raised OverflowError (a traceback instead of exit 2)
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < 1e300:
        raise JobSpecError(f"{where}: field '{key}' must be a finite number > 0, got {str(v)[:40]}")
    if not OBSERVED[0] <= v <= OBSERVED[1]:
        raise JobSpecError(
            f"{where}: field '{key}' must be between {OBSERVED[0]:g} and {OBSERVED[1]:g}, got {str(v)[:40]}"
        )
    return float(v)


def render(report: dict) -> str:
    """Human-readable lines for ``erm plan``."""
    s1 = report["stage1"]
    lines = [f"job signature   {report['signature']}   nodes {report['min_nodes']}..{report['max_nodes']}"]
    if "request" in report:
        r = report["request"]
        lines.append(
            f"user asked      {r['nodes']} node(s), {r['mem_per_node_gib']:.1f} GiB, "
            f"{r['cpu_per_node']:g} cores per node"
        )
    cpu = f", {s1['cpu_per_node']:.1f} cores" if s1["cpu_per_node"] else ""
    lines.append(
        f"stage 1         start with {s1['world']} node(s), {s1['mem_per_node_gib']:.1f} GiB per node{cpu} "
        f"(confidence {s1['confidence']:.2f})"
    )
    lines.append(f"                why: {s1['reason']}")
    m = report["memory_model_gib"]
    lines.append(
        "memory model    per node at start: "
        + ", ".join(f"{k} {v:.2f}" for k, v in m.items() if k != "total")
        + f" = {m['total']:.2f} GiB"
    )
    s2 = report.get("stage2")
    if s2:
        c = ", ".join(f"{k} {v:.3g}" for k, v in s2["coefficients"].items())
        lines.append(f"stage 2 model   {c}; R^2 {s2['r2']:.3f}, rel. RMSE {s2['rel_rmse']:.3f}")
        lines.append(
            f"stage 2         {s2['current_world']} -> {s2['target_world']} node(s): {s2['why']} "
            f"(predicted gain {s2['predicted_gain']:+.1%}, confidence {s2['confidence']:.2f})"
        )
        lines.append("                world   throughput (samples/s, 2-sigma band)")
        for w, (lo, p, hi) in s2["throughput"].items():
            mark = (
                " <- target" if w == s2["target_world"] else (" <- now" if w == s2["current_world"] else "")
            )
            lines.append(f"                {w:>5}   {p:>12,.0f}  [{lo:,.0f} .. {hi:,.0f}]{mark}")
    else:
        lines.append(
            "stage 2         no observations yet: profile the start size, then fit (add 'observations')"
        )
    return "\n".join(lines)
