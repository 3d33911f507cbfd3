"""A picture of a run: world size and throughput over time, with the events marked."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_demo(rows: list[dict], events: list[dict], path: str, window_s: float = 2.0) -> str:
    """``rows``: worker progress lines (t, rank, world, samples); ``events``: {t, kind, text}."""
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
    fig, (ax_w, ax_r) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True)
    ax_w.step(times, worlds, where="post", color="tab:blue")
    ax_w.set_ylabel("world size (nodes)")
    ax_w.set_ylim(0, max(worlds) + 1)
    ax_r.plot(rate_t, rate, color="tab:green")
    ax_r.set_ylabel(f"samples/s ({window_s:.0f}s window)")
    ax_r.set_xlabel("seconds")
    colors = {"fault": "tab:red", "node": "tab:orange", "round": "tab:purple", "stop": "gray"}
    for e in events:
        if e["kind"] not in colors:
            continue
        x = e["t"] - t0
        for ax in (ax_w, ax_r):
            ax.axvline(x, color=colors[e["kind"]], linestyle="--", linewidth=0.8)
        ax_w.annotate(e["text"][:32], (x, 0.1), rotation=90, fontsize=7, va="bottom", ha="right")
    fig.suptitle("elastic-rm: world size and throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
