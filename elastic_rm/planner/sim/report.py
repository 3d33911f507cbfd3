"""Results of simulation runs: per-policy metrics, the comparison table, JSON and PNG plots."""

from __future__ import annotations

import json
import statistics
from collections import Counter

from .model import SimJob
from .regret import distribution, ratios


def _jct(j: SimJob) -> float:
    return j.end_s - j.trace.submit_s


def summarize(jobs: list[SimJob], common: set[str] | None = None) -> dict:
    """Metrics of one policy's run. Utilisation is used / allocated over all node-seconds (the paper's
    CUR/MUR)."""
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
        "node_hours": sum(j.node_s for j in jobs) / 3600,
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
    """Summaries of every policy, with JCT also over the jobs that every policy completed, and (with a
    static run) the distribution of per-job JCT ratios to static (regret.py)."""
    common = completed_by_all(runs)
    out = {name: summarize(jobs, common) for name, jobs in runs.items()}
    if "static" in runs:
        for name, per_job in ratios(runs).items():
            out[name]["jct_ratio_vs_static"] = distribution(per_job)
    return out


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
    ("node-hours", "node_hours", 1),
    ("per-job JCT / static p50", "jct_ratio_vs_static.p50", 1),
    ("per-job JCT / static p90", "jct_ratio_vs_static.p90", 1),
    ("per-job JCT / static p99", "jct_ratio_vs_static.p99", 1),
    ("jobs slowed > 5%", "jct_ratio_vs_static.share_slowed_5pct", 1),
    ("jobs slowed > 25%", "jct_ratio_vs_static.share_slowed_25pct", 1),
)


def _value(s: dict, key: str):
    """A summary's value by key, or by "outer.inner" for the per-job ratio distribution."""
    for part in key.split("."):
        s = s.get(part) if isinstance(s, dict) else None
    return s


def table(summary: dict[str, dict], baseline: str = "static") -> str:
    """Plain-text table: each policy's value and, for JCT, the ratio to the baseline; points for
    utilisation."""
    names = list(summary)
    lines = [f"{'metric':<28}" + "".join(f"{n:>22}" for n in names)]
    base = summary.get(baseline, {})
    for label, key, scale in ROWS:
        cells = []
        for n in names:
            v = _value(summary[n], key)
            if v is None:
                failed = key.startswith("jct_ratio") and _value(summary[n], "jct_ratio_vs_static") is not None
                cells.append(f"{'failed' if failed else '-':>22}")
                continue
            b = _value(base, key)
            if n == baseline or b in (None, 0) or "." in key:
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

    if "static" in runs:
        paths.append(_ratio_cdf(plt, runs, f"{out_dir}/jct_ratio_cdf.png"))

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


def _ratio_cdf(plt, runs: dict[str, list[SimJob]], path: str) -> str:
    """CDF of every job's JCT under each policy over its JCT under static; a job the policy failed (and
    static completed) sits past the right edge, so the curve ends below 1 by the share it failed."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, per_job in ratios(runs).items():
        if name == "static":
            continue
        xs = sorted(per_job.values())
        finite = [max(x, 1e-2) for x in xs if x != float("inf")]
        if finite:
            ax.step(finite, [(i + 1) / len(xs) for i in range(len(finite))], where="post", label=name)
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.axvline(1.05, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("per-job JCT / JCT under static (same job, same seed)")
    ax.set_ylabel("CDF of jobs")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_html(path: str, summary: dict[str, dict], images: list[str], title: str) -> str:
    """A self-contained page: the comparison table and every plot (the per-job ratio CDF first)."""
    import base64
    import html
    import os

    order = sorted(images, key=lambda p: not p.endswith("jct_ratio_cdf.png"))
    figs = []
    for img in order:
        with open(img, "rb") as f:
            data = base64.b64encode(f.read()).decode()
        figs.append(f'<img alt="{html.escape(os.path.basename(img))}" src="data:image/png;base64,{data}">')
    body = "\n".join(figs)
    page = (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title></head>"
        f"<body><h1>{html.escape(title)}</h1><pre>{html.escape(table(summary))}</pre>\n{body}</body></html>\n"
    )
    with open(path, "w") as f:
        f.write(page)
    return path
