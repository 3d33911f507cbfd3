"""Per-job regret: each job's JCT under a policy over its JCT under the user's own size (static).

The mean JCT of a trace can improve while half its jobs run slower (the queueing saved for some pays for
the exploration that costs others), so what a user is promised is judged job by job: the same arrivals,
the same seed, the same job under both policies. A job a policy did not complete that static did counts
as slowed without bound (ratio infinite); one static did not complete that the policy did counts as not
slowed (ratio 0); one neither completed is compared on the time each ran before it ended.
"""

from __future__ import annotations

import math

SLOWED = (0.05, 0.25)  # the shares reported: jobs more than 5% and more than 25% later than static


class RegretError(ValueError):
    """The policies' results do not hold the same jobs: no per-job ratio can be formed."""


def _jct(j) -> float:
    return j.end_s - j.trace.submit_s


def job_ratio(job, base) -> float:
    """JCT under the policy / JCT under the baseline, for one job run under both."""
    done, base_done = job.status == "completed", base.status == "completed"
    if done and base_done:
        return _jct(job) / max(_jct(base), 1e-9)
    if base_done:
        return math.inf
    if done:
        return 0.0
    a, b = _jct(job), _jct(base)
    if math.isnan(a) or math.isnan(b):  # one of them never started or ended: same outcome, no time
        return 1.0
    return a / max(b, 1e-9)


def ratios(runs: dict[str, list], baseline: str = "static") -> dict[str, dict[str, float]]:
    """{policy: {job id: ratio}} for every policy, the baseline included (all 1.0). Every policy must hold
    exactly the baseline's jobs: a job missing from one is a :class:`RegretError`, not a skipped row."""
    if baseline not in runs:
        raise RegretError(f"per-job ratios need the {baseline!r} policy's run (add it to --policies)")
    base = {j.trace.job_id: j for j in runs[baseline]}
    out = {}
    for name, jobs in runs.items():
        by_id = {j.trace.job_id: j for j in jobs}
        missing = sorted(set(base) - set(by_id))
        extra = sorted(set(by_id) - set(base))
        if missing or extra or len(by_id) != len(jobs):
            what = f"missing {missing[:3]}" if missing else f"not in {baseline}'s run {extra[:3]}"
            raise RegretError(f"policy {name!r}: its jobs are not {baseline}'s ({what}, {len(jobs)} rows)")
        out[name] = {k: job_ratio(by_id[k], base[k]) for k in sorted(base)}
    return out


def quantile(values: list[float], q: float) -> float:
    """Nearest-rank quantile (a value of the list, so an infinite ratio stays one)."""
    xs = sorted(values)
    return xs[min(max(math.ceil(q * len(xs)) - 1, 0), len(xs) - 1)]


def distribution(per_job: dict[str, float]) -> dict[str, float | int | None]:
    """p50/p90/p99 of the ratios and the shares slowed by more than 5% and 25% (fractions 0..1). A
    quantile that falls on a job the policy failed is None (JSON has no infinity): the job did not end."""
    xs = list(per_job.values())
    if not xs:
        return {
            "jobs": 0,
            "p50": None,
            "p90": None,
            "p99": None,
            "share_slowed_5pct": None,
            "share_slowed_25pct": None,
            "failed_only_here": 0,
        }
    out: dict[str, float | int | None] = {"jobs": len(xs)}
    for q in (0.5, 0.9, 0.99):
        v = quantile(xs, q)
        out[f"p{round(q * 100)}"] = v if math.isfinite(v) else None
    for s in SLOWED:
        out[f"share_slowed_{round(s * 100)}pct"] = sum(x > 1 + s for x in xs) / len(xs)
    out["failed_only_here"] = sum(math.isinf(x) for x in xs)
    return out
