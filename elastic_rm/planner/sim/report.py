"""Results of simulation runs: per-policy metrics, the comparison table, JSON and PNG plots."""

from __future__ import annotations

import json
import statistics
from collections import Counter

from .model import SimJob


def _jct(j: SimJob) -> float:
    return j.end_s - j.trace.submit_s


def summarize(jobs: list[SimJob], common: set[str] | None = None) -> dict:
    """Metrics of one policy's run. Utilisation is used / allocated over all node-seconds (the paper's CUR/MUR)."""
    done = [j for j in jobs if j.status == "completed"]
    jct = [_jct(j) for j in done]
    usage = [sum(j.usage[i] for j in jobs) for i in range(6)]
    out = {
        "jobs": len(jobs),
        "completed": len(done),
        "completion_rate": len(done) / len(jobs) if jobs else 0.0,
        "mean_jct_s": statistics.fmean(jct) if jct else None,
        "median_jct_s": statistics.median(jct) if jct else None,
        "mean_queue_s": statistics.fmean(j.start_s - j.trace.submit_s for j in done) if done else None,
        "mean_run_s": statistics.fmean(j.end_s - j.start_s for j in done) if done else None,
        "cpu_util": usage[1] / usage[0] if usage[0] else 0.0,
        "mem_util": usage[3] / usage[2] if usage[2] else 0.0,
        "gpu_util": usage[5] / usage[4] if usage[4] else 0.0,
        "rounds_per_job": statistics.fmean(j.rounds for j in jobs) if jobs else 0.0,
        "outcomes": dict(
            Counter(j.reason.split(" (")[0].split(",")[0] for j in jobs if j.status != "completed")
        ),
    }
    if common is not None:
        c = [_jct(j) for j in done if j.trace.job_id in common]
        out["common_jobs"] = len(c)
        out["mean_jct_common_s"] = statistics.fmean(c) if c else None
        out["median_jct_common_s"] = statistics.median(c) if c else None
    small = [j for j in jobs if j.trace.req_nodes <= 8]
    large = [j for j in jobs if j.trace.req_nodes > 8]
    out["completion_rate_small"] = sum(j.status == "completed" for j in small) / max(len(small), 1)
    out["completion_rate_large"] = sum(j.status == "completed" for j in large) / max(len(large), 1)
    return out


def completed_by_all(runs: dict[str, list[SimJob]]) -> set[str]:
    """The ids of the jobs that every policy completed (the common jobs)."""
    sets = [{j.trace.job_id for j in jobs if j.status == "completed"} for jobs in runs.values()]
    return set.intersection(*sets) if sets else set()


def compare(runs: dict[str, list[SimJob]]) -> dict[str, dict]:
    """Summaries of every policy, with JCT also over the jobs that every policy completed."""
    common = completed_by_all(runs)
    return {name: summarize(jobs, common) for name, jobs in runs.items()}


ROWS = (
    ("mean JCT (h)", "mean_jct_s", 1 / 3600),
    ("median JCT (h)", "median_jct_s", 1 / 3600),
    ("mean JCT, common jobs (h)", "mean_jct_common_s", 1 / 3600),
    ("mean queueing (h)", "mean_queue_s", 1 / 3600),
    ("mean run time (h)", "mean_run_s", 1 / 3600),
    ("completion rate", "completion_rate", 1),
    ("  jobs <= 8 nodes", "completion_rate_small", 1),
    ("  jobs > 8 nodes", "completion_rate_large", 1),
    ("CPU utilisation", "cpu_util", 1),
    ("memory utilisation", "mem_util", 1),
    ("GPU utilisation", "gpu_util", 1),
    ("rounds per job", "rounds_per_job", 1),
)


def table(summary: dict[str, dict], baseline: str = "static") -> str:
    """Plain-text table: each policy's value and, for JCT, the ratio to the baseline; points for utilisation."""
    names = list(summary)
    lines = [f"{'metric':<28}" + "".join(f"{n:>22}" for n in names)]
    base = summary.get(baseline, {})
    for label, key, scale in ROWS:
        cells = []
        for n in names:
            v = summary[n].get(key)
            if v is None:
                cells.append(f"{'-':>22}")
                continue
            b = base.get(key)
            if n == baseline or b in (None, 0):
                extra = ""
            elif key.endswith("_s"):
                extra = f" ({v / b - 1:+.1%})"
            elif key.endswith("util") or key.startswith("completion"):
                extra = f" ({(v - b) * 100:+.1f} pt)"
            else:
                extra = ""
            cells.append(f"{v * scale:>12.3f}{extra:>10}")
        lines.append(f"{label:<28}" + "".join(cells))
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, sort_keys=True, default=_plain)
        f.write("\n")


def _plain(value: object) -> object:
    """A numpy scalar as the Python value it holds (a bool stays a bool); anything else as a float."""
    item = getattr(value, "item", None)
    return item() if callable(item) else float(value)  # type: ignore[arg-type]


def plot(
    runs: dict[str, list[SimJob]], timelines: dict[str, list[tuple]], summary: dict[str, dict], out_dir: str
) -> list[str]:
    """PNG plots: JCT CDF, utilisation bars, allocated share of the cluster over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, jobs in runs.items():
        xs = sorted(_jct(j) / 3600 for j in jobs if j.status == "completed")
        if xs:
            ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("JCT (h)")
    ax.set_ylabel("CDF of completed jobs")
    ax.legend()
    fig.tight_layout()
    paths.append(f"{out_dir}/jct_cdf.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    keys = ("cpu_util", "mem_util", "gpu_util", "completion_rate")
    width = 0.8 / max(len(summary), 1)
    for i, (name, s) in enumerate(summary.items()):
        ax.bar([k + i * width for k in range(len(keys))], [s[k] for k in keys], width, label=name)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(keys))], [k.replace("_", " ") for k in keys])
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    paths.append(f"{out_dir}/utilisation.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, tl in timelines.items():
        if tl:
            ax.plot([r[0] / 3600 for r in tl], [r[1] for r in tl], label=f"{name}: CPU allocated")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("share of the cluster")
    ax.legend()
    fig.tight_layout()
    paths.append(f"{out_dir}/cluster_allocation.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
