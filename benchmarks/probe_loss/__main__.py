"""Run the probe-loss benchmark (see benchmarks/probe_loss/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import stop_processes, write_result
from benchmarks.probe_loss import CLOCKS, PREVIOUS_TIMEOUT_S, replay
from elastic_rm.rendezvous.peer_probe import PROBE_INTERVAL_S
from elastic_rm.rendezvous.peer_sockets import CONNECT_TIMEOUT_S
from elastic_rm.rendezvous.settings import DEFAULT_LEASE_TTL
from tests.netns.hosts import Network, why_unavailable

REPO = Path(__file__).resolve().parents[2]
ROLES = [sys.executable, "-m", "benchmarks.probe_loss.roles"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def start_listener(host, port: int, for_s: float) -> subprocess.Popen:
    proc = subprocess.Popen(
        host.argv([*ROLES, "listen", "--port", str(port), "--for-s", str(for_s)]),
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=ENV,
    )
    if proc.stdout.readline().strip() != "listening":
        raise RuntimeError(f"the listener on {host.name} did not start (exit status {proc.poll()})")
    return proc


def measure(prober, targets: dict[str, tuple[str, int]], probes: int, timeouts: list[float]) -> list[dict]:
    """``probes`` probes of ``targets`` from the ``prober`` host, at each timeout: their JSON rows."""
    argv = [*ROLES, "probe", "--probes", str(probes), "--timeouts", *map(str, timeouts)]
    argv += [f"--target={n}={a}:{p}" for n, (a, p) in targets.items()]
    bound = 60 + probes * len(timeouts) * (max(timeouts) + 0.5)
    out = subprocess.run(prober.argv(argv), capture_output=True, text=True, cwd=REPO, env=ENV, timeout=bound)
    if out.returncode != 0:
        raise RuntimeError(f"the prober failed: {out.stderr.strip()[-2000:]}")
    return [json.loads(line) for line in out.stdout.splitlines()]


def analyse(rows: list[dict], peers: list[str], timeouts: list[float], window_s: float) -> list[dict]:
    """Per timeout (in order): the share of connects that failed, and per clock its step-outs over the
    replay (a list, not keys: the figure markers of docs/ join keys with dots)."""
    out = []
    for timeout_s in timeouts:
        probes = [r for r in rows if r["timeout_s"] == timeout_s]
        failed = sum(len(r["lost"]) for r in probes) / (len(peers) * len(probes))
        row = {"timeout_s": timeout_s, "probes": len(probes), "connects_failed": round(failed, 4)}
        for name, clock in CLOCKS.items():
            got = replay(probes, peers, set(peers), clock(window_s))
            got["per_hour"] = round(got["step_outs"] * 3600 / got["replayed_s"], 1)
            row[name] = got
        out.append(row)
    return out


def report(rows: list[dict], cut: list[dict], timeouts: list[float]) -> list[dict]:
    """Print the table and the ratios; return them (the previous rule at the previous timeout against the
    current one at the current timeout, per loss level)."""
    print(
        f"{'loss':>6} {'dropped':>8} {'timeout':>8} {'failed':>7} {'naive/h':>8} {'per peer/h':>11} "
        f"{'hours':>6}"
    )
    for row in rows:
        for r in row["timeouts"]:
            print(
                f"{row['loss']:>6g} {row['dropped']:>8.1%} {r['timeout_s']:>6g} s "
                f"{r['connects_failed']:>7.1%} "
                f"{r['naive']['per_hour']:>8.1f} {r['per_peer']['per_hour']:>11.1f} "
                f"{r['naive']['replayed_s'] / 3600:>6.2f}"
            )
    vs_naive = []
    for row in rows:
        before, after = row["timeouts"][0]["naive"], row["timeouts"][1]["per_peer"]
        hours = round(after["replayed_s"] / 3600, 2)
        ratio = round(before["per_hour"] / after["per_hour"], 1) if after["step_outs"] else None
        vs_naive.append(
            {
                "loss": row["loss"],
                "naive_per_hour": before["per_hour"],
                "current_per_hour": after["per_hour"],
                "current_hours": hours,
                "ratio": ratio,
            }
        )
        print(
            f"loss {row['loss']:g}: false step-outs per hour, current (per peer, {timeouts[1]:g} s) "
            f"{after['per_hour']:.1f} vs naive (the previous rule, {timeouts[0]:g} s) "
            f"{before['per_hour']:.1f}: "
            + (f"{ratio:.1f}x fewer" if ratio else f"none in {hours} h replayed")
        )
    for r in cut:
        got = ", ".join(f"{name} {r[name]['first_step_out_s']} s" for name in CLOCKS)
        print(
            f"cut off from both peers, timeout {r['timeout_s']:g} s: stepped out after (from the cut) {got}"
        )
    return vs_naive


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_loss", description=__doc__)
    p.add_argument("--loss", type=float, nargs="+", default=[0.05, 0.10], help="loss on every link, each way")
    p.add_argument("--probes", type=int, default=1000, help="probes per loss level and timeout")
    p.add_argument("--cut-probes", type=int, default=12, help="probes across a real cut")
    p.add_argument("--window", type=float, default=float(DEFAULT_LEASE_TTL), help="peer_probe (s)")
    p.add_argument("--port", type=int, default=7791)
    p.add_argument("--out", default="probe-loss")
    args = p.parse_args()
    if why := why_unavailable():
        print(f"probe_loss: {why}", file=sys.stderr)
        return 2
    timeouts = [PREVIOUS_TIMEOUT_S, CONNECT_TIMEOUT_S]
    rows, procs = [], []
    with Network(3) as net:
        h0, *peers = net.hosts
        try:
            procs += [start_listener(h, args.port, 3600.0) for h in peers]
            targets = {h.name: (h.addr, args.port) for h in peers}
            names = sorted(targets)  # h0 ranks after both: a tie against either may take it out
            for loss in args.loss:
                for h in net.hosts:
                    h.lossy(loss)
                measured = measure(h0, targets, args.probes, timeouts)
                packets = [h.packets() for h in net.hosts]
                for h in net.hosts:
                    h.lossless()
                sent, dropped = sum(s for s, _ in packets), sum(d for _, d in packets)
                results = analyse(measured, names, timeouts, args.window)
                rows.append({"loss": loss, "dropped": round(dropped / sent, 4), "timeouts": results})
            for h in peers:  # their answers to h0 go nowhere: h0's connects get no answer, as across a cut
                h.blackhole(h0.addr)
            cut = analyse(measure(h0, targets, args.cut_probes, timeouts), names, timeouts, args.window)
            for h in peers:
                h.unblackhole(h0.addr)
        finally:
            stop_processes(procs)
    print(
        f"window {args.window:g} s, a probe every {PROBE_INTERVAL_S:g} s after the last; h0 ranks after "
        "its peers"
    )
    vs_naive = report(rows, cut, timeouts)
    path = write_result(
        args.out,
        {
            "window_s": args.window,
            "interval_s": PROBE_INTERVAL_S,
            "timeouts_s": timeouts,
            "loss": rows,
            "cut": cut,
            "vs_naive": vs_naive,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
