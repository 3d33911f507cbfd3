"""Per-job evidence: which jobs ran later under the planner than under static, and the planner's own
record of why (its decisions), grouped by cause."""

from __future__ import annotations

import re
from collections import defaultdict

from elastic_rm.planner.sim.report import completed_by_all

_SCALE = re.compile(r"^scale (up|down) (\d+) -> (\d+): ")
# the start size the first round's reason names: a cold start's "; N node(s)", a warm start's ": N node(s)"
_PLANNED = re.compile(
    r"(?:cold start: [^;]*; |warm start from \d+ finished run\(s\) of \S+: )(\d+) node\(s\)"
)


def _texts(job) -> list[str]:
    """The job's decisions without their times ("960s: first round of ..." -> "first round of ...")."""
    return [d.split(": ", 1)[1] if ": " in d else d for d in job.decisions]


def _scales(job) -> list[tuple[str, int, int, str]]:
    """(direction, from, to, reason) of every scale-up and scale-down the planner decided."""
    out = []
    for text in _texts(job):
        m = _SCALE.match(text)
        if m:
            out.append((m.group(1), int(m.group(2)), int(m.group(3)), text[m.end() :]))
    return out


def _planned(job) -> int:
    """The start size stage 1 chose (the first round's size where its reason names none)."""
    first = " | ".join(job.decisions[:1])
    m = _PLANNED.search(first)
    return int(m.group(1)) if m else _first(first)


def _lent_back(why: str) -> bool:
    """Whether a scale-down's reason is lent nodes given back to a queue (lending.py's reason)."""
    return "lent" in why


def _down(job, below: bool) -> bool:
    """A scale-down stage 2 chose (not a stop-loss, a probe or lent nodes given back), to a size below the
    request (``below``) or not."""
    req = job.trace.req_nodes
    return any(
        d == "down"
        and (b < req) == below
        and not why.startswith(("stop-loss", "probe:"))
        and not _lent_back(why)
        for d, _, b, why in _scales(job)
    )


# What the planner's own decisions say cost a job (a job counts under every cause that applies):
CAUSES = (
    ("start below the request (the warm start's size)", lambda j, s, d: _planned(j) < j.trace.req_nodes),
    (
        "start short of its size (too few free nodes)",
        lambda j, s, d: _first(d) < min(_planned(j), j.trace.req_nodes),
    ),
    ("OOM", lambda j, s, d: "OOM happened" in d),
    ("memory raised (OOM predicted)", lambda j, s, d: "OOM predicted" in d),
    ("scale-down below the request", lambda j, s, d: _down(j, below=True)),
    ("scale-down, not below the request", lambda j, s, d: _down(j, below=False)),
    (
        "lent nodes given back",
        lambda j, s, d: any(a == "down" and _lent_back(why) for a, _, _, why in _scales(j)),
    ),
    ("one-node probe", lambda j, s, d: "probe:" in d),
    (
        "stage-2 scale-up",
        lambda j, s, d: any(
            a == "up" and not why.startswith("toward the start size") for a, _, _, why in _scales(j)
        ),
    ),
    ("stop-loss", lambda j, s, d: "stop-loss" in d),
    ("resize round (budgets)", lambda j, s, d: "resize to" in d),
    ("straggler round", lambda j, s, d: "straggler" in d),
    ("queued longer", lambda j, s, d: j.start_s > s.start_s),
)


def _first(decisions: str) -> int:
    m = re.search(r"first round of (\d+)", decisions)
    return int(m.group(1)) if m else 0


def slower_jobs(runs: dict[str, list], policy: str = "ours", base: str = "static", tol: float = 0.02) -> dict:
    """Jobs both completed whose JCT under ``policy`` exceeds ``base``'s by more than ``tol``, by cause.

    A job counts under every cause that applies; ``hours`` is the sum of their extra JCT."""
    by_id = {j.trace.job_id: j for j in runs[base]}
    out: dict[str, dict] = defaultdict(lambda: {"jobs": 0, "hours": 0.0})
    total = slower = 0
    for j in runs[policy]:
        s = by_id[j.trace.job_id]
        if j.status != "completed" or s.status != "completed":
            continue
        total += 1
        extra = j.end_s - s.end_s
        if extra <= tol * (s.end_s - s.trace.submit_s):
            continue
        slower += 1
        d = " | ".join(j.decisions)
        hit = [name for name, test in CAUSES if test(j, s, d)] or ["other"]
        for name in hit:
            out[name]["jobs"] += 1
            out[name]["hours"] += extra / 3600
    return {"jobs_compared": total, "jobs_slower": slower, "by_cause": dict(out)}


def lent_nodes(runs: dict[str, list], policy: str = "ours", base: str = "optimus") -> dict:
    """Queueing behind lent nodes: jobs that started later under ``policy`` than under ``base`` and, while
    they queued, other jobs held nodes past their request (node-hours); and for every policy, the queued
    job x lent node hours, the jobs that grew past their request and those that started past it."""
    by_id = {j.trace.job_id: j for j in runs[base]}
    later = behind = 0
    node_h = 0.0
    for j in runs[policy]:
        b = by_id[j.trace.job_id]
        if j.start_s != j.start_s or b.start_s != b.start_s or j.start_s <= b.start_s:  # NaN: never started
            continue
        later += 1
        if j.queued_behind_lent_s > 0:
            behind += 1
            node_h += j.queued_behind_lent_s / 3600
    return {
        "queued_job_x_lent_node_hours": {
            p: sum(j.queued_behind_lent_s for j in js) / 3600 for p, js in runs.items()
        },
        f"started_later_than_{base}": later,
        "of_them_queued_behind_lent_nodes": behind,
        "lent_node_hours_they_queued_behind": node_h,
        "jobs_grown_past_request": {p: sum(1 for j in js if j.peak_lent > 0) for p, js in runs.items()},
        "jobs_started_past_request": {
            p: sum(1 for j in js if _first(" | ".join(j.decisions[:1])) > j.trace.req_nodes)
            for p, js in runs.items()
        },
    }


def completion_split(runs: dict[str, list], base: str = "optimus") -> dict:
    """Where each policy's GPUs went: GPU-hours allocated to the jobs every policy completed, to the jobs it
    completed and ``base`` did not, and to the rest; and the mean queueing over the common jobs. A policy
    that completes jobs another fails spends GPUs on them that the other gives to its queue, so means over
    different sets of completed jobs compare different work."""
    done = {p: {j.trace.job_id for j in js if j.status == "completed"} for p, js in runs.items()}
    common = completed_by_all(runs)
    out = {}
    for p, js in runs.items():
        only = done[p] - done[base] if p != base else set()
        split = {"common": 0.0, f"completed_not_by_{base}": 0.0, "other": 0.0}
        queue = []
        for j in js:
            jid = j.trace.job_id
            key = "common" if jid in common else f"completed_not_by_{base}" if jid in only else "other"
            split[key] += j.usage[4] / 3600
            if jid in common:
                queue.append(j.start_s - j.trace.submit_s)
        out[p] = {
            "gpu_hours": split,
            f"jobs_completed_not_by_{base}": len(only),
            "mean_queue_common_s": sum(queue) / len(queue) if queue else None,
        }
    return {"common_jobs": len(common), "by_policy": out}
