"""The scale benchmark's failure round: one node SIGKILLed, until every survivor holds the next round;
and what the survivors' processes report about their leases meanwhile."""

from __future__ import annotations

import os
import queue
import signal
import time

from benchmarks.scale.child import Child


def failure_round(victim: Child, children: list[Child], n: int, run: str) -> dict:
    survivors = [c for c in children if c is not victim]
    t_kill = time.time()
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    seen: dict[str, float] = {}
    process_of: dict[str, int] = {}  # node -> index of its process in ``survivors``
    written = float("inf")  # when the leader wrote the survivors' round (its record's time)
    errors = []
    deadline = time.time() + 60
    while len(seen) < n - 1 and time.time() < deadline:
        for i, c in enumerate(survivors):
            try:
                while True:
                    item = c.lines.get_nowait()
                    if item.get("ev") != "round":
                        continue
                    if "error" in item:
                        errors.append(item["error"])
                    elif item["world"] == n - 1:
                        seen[item["node"]] = item["t"]
                        process_of[item["node"]] = i
                        written = min(written, item["round_time"])
            except queue.Empty:
                pass
        time.sleep(0.05)
    ok = len(seen) == n - 1 and not errors
    after = sorted(t - t_kill for t in seen.values())
    last_by_process: dict[int, float] = {}
    for node, t in seen.items():
        last_by_process[process_of[node]] = max(last_by_process.get(process_of[node], 0.0), t - t_kill)
    # the breakdown: the round's write after the kill (the loss found, the lease ended, the leader's
    # decision), then the fan-out to the survivors (the first, the median, the last to hold it)
    return {
        "ok": ok,
        "latency_s": (max(seen.values()) - t_kill) if ok else None,
        "survivors_in_round": len(seen),
        "errors": errors[:3],
        "round_written_s": written - t_kill if seen else None,
        "first_s": after[0] if after else None,
        "median_s": quantile(after, 0.5),
        "p90_s": quantile(after, 0.9),
        "p99_s": quantile(after, 0.99),
        "last_by_process_s": [round(last_by_process[i], 3) for i in sorted(last_by_process)],
    }


def quantile(values: list[float], q: float) -> float | None:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))] if values else None


def keepalive_stats(reports: list[dict]) -> dict:
    """The node processes' I/O loop lag (how late a keep-alive due runs) and keep-alive streams reopened."""
    reopens = [r.get("keepalive_reopens", {}) for r in reports]
    return {
        "max_io_loop_lag_s": max(r.get("max_loop_lag_s", 0.0) for r in reports),
        "keepalive_reopens": {k: sum(x.get(k, 0) for x in reopens) for k in ("no_answer", "failed")},
        "keepalive_streams_opened": sum(r.get("keepalive_streams", 0) for r in reports),
    }


def settle(children: list[Child], quiet_s: float = 5.0, limit_s: float = 120.0) -> dict:
    """Wait until no node joined a new round for ``quiet_s`` (a join that lost leases churns a while), so
    that the failure round starts from a stable world; how many rounds were joined meanwhile."""
    t0 = last = time.monotonic()
    churned = 0
    while time.monotonic() - last < quiet_s and time.monotonic() - t0 < limit_s:
        for c in children:
            try:
                while True:
                    item = c.lines.get_nowait()
                    c.other.append(item)
                    if item.get("ev") == "round":
                        churned, last = churned + 1, time.monotonic()
            except queue.Empty:
                pass
        time.sleep(0.1)
    return {
        "rounds_joined_after_the_join": churned,
        "settle_s": time.monotonic() - t0,
        "settled": time.monotonic() - last >= quiet_s,
    }


def reports_of(children: list[Child]) -> list[dict]:
    for c in children:
        c.send("report")
    return [c.expect("report", 60) for c in children]


def after_failure(children: list[Child], victim: Child) -> dict:
    """Leases lost by live nodes since the start (join and failure round) and the longest refresh gap."""
    reports = reports_of([c for c in children if c is not victim])
    return {
        "lease_lost": sum(r["lease_lost"] for r in reports),
        "max_keepalive_gap_s": max(r["max_gap_s"] for r in reports),
        **keepalive_stats(reports),
        "lease_ttl_s": reports[0]["lease_ttl_s"],
        "load_avg": os.getloadavg(),
    }
