"""A picture of a run: world size and throughput over time, with the events marked."""

from __future__ import annotations

import time

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_demo(rows: list[dict], events: list[dict], path: str, window_s: float = 2.0) -> str:
    """``rows``: worker progress lines (t, rank, world, samples); ``events``: {t, kind, text}."""
    fig = demo_figure(rows, events, window_s)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def demo_figure(rows: list[dict], events: list[dict], window_s: float = 2.0):
    """The demo's picture: each marked event numbered at its line, and named in a list under the panels
    (labels written along the lines overlapped when phases came seconds apart)."""
    steps = sorted((r for r in rows if "step" in r and r.get("rank") == 0), key=lambda r: r["t"])
    if not steps:
        raise ValueError("no training progress to plot")
    t0 = min([steps[0]["t"]] + [e["t"] for e in events])
    times = [r["t"] - t0 for r in steps]
    worlds = [r["world"] for r in steps]
    all_steps = sorted((r for r in rows if "step" in r), key=lambda r: r["t"])
    rate_t, rate = [], []
    for prev, r in zip([None, *steps], steps, strict=False):
        if prev is not None and r["t"] - prev["t"] > window_s:  # a pause: show it as zero, not a ramp
            rate_t += [prev["t"] - t0 + 0.01, r["t"] - t0 - 0.01]
            rate += [0.0, 0.0]
        lo = r["t"] - window_s
        samples = sum(x.get("samples", 0) for x in all_steps if lo < x["t"] <= r["t"])
        rate_t.append(r["t"] - t0)
        rate.append(samples / window_s)
    colors = {"fault": "tab:red", "node": "tab:orange", "round": "tab:purple", "stop": "gray"}
    marked = [e for e in events if e["kind"] in colors]
    footer_in = 0.22 * (len(marked) + 1)
    fig, (ax_w, ax_r) = plt.subplots(2, 1, figsize=(10, 5.5 + footer_in), sharex=True)
    ax_w.step(times, worlds, where="post", color="tab:blue")
    ax_w.set_ylabel("world size (nodes)")
    ax_w.set_ylim(0, max(worlds) + 1)
    ax_r.plot(rate_t, rate, color="tab:green")
    ax_r.set_ylabel(f"samples/s ({window_s:.0f}s window)")
    ax_r.set_xlabel("seconds")
    lines = []
    for number, e in enumerate(marked, start=1):
        x = e["t"] - t0
        for ax in (ax_w, ax_r):
            ax.axvline(x, color=colors[e["kind"]], linestyle="--", linewidth=0.8)
        # numbers of events close in time stack upwards instead of covering each other
        close = sum(
            1 for other in marked[: number - 1] if abs(other["t"] - e["t"]) < 0.02 * (max(times) or 1)
        )
        ax_w.annotate(
            str(number),
            (x, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, 2 + 9 * close),
            textcoords="offset points",
            fontsize=7,
            color=colors[e["kind"]],
        )
        lines.append(f"{number}  {x:6.1f} s  {e['kind']}: {e['text'][:100]}")
    fig.suptitle("elastic-rm: world size and throughput")
    fig.tight_layout(rect=(0, footer_in / (5.5 + footer_in), 1, 1))
    if lines:
        fig.text(0.01, 0.01, "\n".join(lines), fontsize=7, family="monospace", va="bottom")
    return fig


MAX_LISTED = 12  # decisions named under the picture (the HTML page has them all)


def plot_run(run, path: str) -> list[str]:
    """``erm report``'s picture of a recorded run (:class:`elastic_rm.obs.run_report.RunData`): world size,
    throughput, and per-node CPU, memory and GPU utilisation over time, each decision marked on every panel
    and named on the top one. Returns the decision labels drawn (for tests and the HTML page)."""
    samples = [e for e in run.events if e.kind == "sample"]
    times = [e.time for e in run.events] + [d["time"] for d in run.decisions if d.get("time")]
    if not times:
        raise ValueError("nothing to plot: the run has no events and no decisions")
    t0 = min(times)
    nodes = sorted({e.node for e in samples})
    marked = [d for d in run.decisions if d.get("time")]
    shown = marked[-MAX_LISTED:]
    footer_in = 0.2 * (len(shown) + 2)
    fig, axes = plt.subplots(5, 1, figsize=(11, 10 + footer_in), sharex=True)
    ax_w, ax_r, ax_c, ax_m, ax_g = axes
    # world size: a step function over the decisions
    steps = sorted((d["time"] - t0, len(d["members"])) for d in run.decisions if d.get("time"))
    if steps:
        end = max(times) - t0
        ax_w.step([x for x, _ in steps] + [end], [w for _, w in steps] + [steps[-1][1]], where="post")
        ax_w.set_ylim(0, max(w for _, w in steps) + 1)
    ax_w.set_ylabel("world (nodes)")
    # throughput: per node, and the total of each node's latest sample
    latest: dict[str, tuple[object, float]] = {}  # node -> (round, samples/s) of its newest sample
    total_t, total = [], []
    for e in samples:
        rate = e.data.get("samples_per_s")
        latest[e.node] = (e.data.get("round"), rate if isinstance(rate, (int, float)) else 0.0)
        total_t.append(e.time - t0)  # nodes whose newest sample is of an older round have left it
        total.append(sum(r for n, r in latest.values() if n == e.data.get("round")))
    for node in nodes:
        mine = [e for e in samples if e.node == node]
        ax_r.plot(
            [e.time - t0 for e in mine],
            [_num(e.data.get("samples_per_s")) for e in mine],
            linewidth=0.8,
            alpha=0.7,
            label=node,
        )
        ax_c.plot([e.time - t0 for e in mine], [_num(e.data.get("cpu")) for e in mine], label=node)
        ax_m.plot([e.time - t0 for e in mine], [_mem(e.data) for e in mine], label=node)
        gpu = [_gpu(e.data) for e in mine]
        if any(g is not None for g in gpu):
            ax_g.plot(
                [e.time - t0 for e in mine], [float("nan") if g is None else g for g in gpu], label=node
            )
    if total:
        ax_r.step(total_t, total, where="post", color="black", linewidth=1.4, label="total")
    ax_r.set_ylabel("samples/s")
    ax_c.set_ylabel("CPU (of node)")
    ax_m.set_ylabel("memory used")
    ax_g.set_ylabel("GPU util")
    for ax in (ax_c, ax_m, ax_g):
        ax.set_ylim(0, 1.05)
        ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    if not any(_gpu(e.data) is not None for e in samples):
        ax_g.text(
            0.5, 0.5, "no GPU reported", transform=ax_g.transAxes, ha="center", va="center", color="gray"
        )
    if not samples:
        ax_r.text(
            0.5, 0.5, "no samples in the event log", transform=ax_r.transAxes, ha="center", color="gray"
        )
    for ax in (ax_r, ax_c):
        if nodes:
            ax.legend(loc="upper left", fontsize=7, ncol=min(6, len(nodes) + 1))
    for d in marked:
        x = d["time"] - t0
        for ax in axes:
            ax.axvline(x, color="tab:purple", linestyle="--", linewidth=0.8)
        ax_w.annotate(
            f"r{d['round']}",
            (x, 0.97),
            xycoords=("data", "axes fraction"),
            fontsize=8,
            va="top",
            ha="left",
            color="tab:purple",
        )
    labels = [
        f"round {d['round']}: {len(d['members'])} node(s), {d['reason'] or 'no reason'}"[:110]
        + f"  (at {d['time'] - t0:.0f} s)"
        for d in shown
    ]
    if len(marked) > len(shown):
        labels.insert(0, f"... {len(marked) - len(shown)} earlier decision(s) in the HTML page")
    fig.text(
        0.06,
        0.2 / (10 + footer_in),
        "\n".join(["decisions:", *labels]),
        fontsize=8,
        va="bottom",
        color="tab:purple",
        family="monospace",
        linespacing=1.5,
    )
    for e in run.events:
        if e.kind in ("failure", "node"):
            for ax in axes:
                ax.axvline(e.time - t0, color="tab:red", linestyle=":", linewidth=0.8)
    ax_g.set_xlabel(f"seconds since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(t0))}")
    fig.suptitle(f"elastic-rm run {run.run_id}: decisions (purple), failures (red)")
    fig.tight_layout(rect=(0, (footer_in + 0.1) / (10 + footer_in), 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else float("nan")


def _mem(data: dict) -> float:
    used, total = data.get("mem_used_bytes"), data.get("mem_total_bytes")
    return _num(used) / total if isinstance(total, (int, float)) and total > 0 else float("nan")


def _gpu(data: dict) -> float | None:
    utils = [u for u in data.get("gpu_util") or [] if isinstance(u, (int, float))]
    return sum(utils) / len(utils) if utils else None
