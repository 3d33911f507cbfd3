"""Keep-alive benchmark: what keeping many leases alive costs a process, batched and not.

A process of the scale benchmark holds 128 simulated nodes, each with its own client and lease, and their
refreshes were most of a waiting node's control-plane CPU. Each trial starts one process per variant
(a fresh etcd each), grants ``--leases`` leases of ``--ttl`` s on as many clients, lets the refreshes
settle for two TTLs and measures the process's CPU over ``--seconds``, with the longest gap between two
refreshes of any lease and the leases lost. Variants, alternating, in the same run:

- ``batched`` (this version): a stream's leases due within half their interval go with the one due now
  (``keepalive.BATCH_AHEAD``), so they come onto one schedule;
- ``per-lease`` (the baseline): ``BATCH_AHEAD = 0``, every lease on its own schedule,
  one wake-up of its stream per lease.

Writes benchmarks/results/keepalive.json. Run: ``python -m benchmarks.keepalive --trials 3``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.common import summarize, write_result

VARIANTS = {"batched": None, "per-lease": 0.0}  # BATCH_AHEAD (None: the library's own)


def measure(leases: int, seconds: float, ttl: int, batch_ahead: float | None) -> dict:
    """In this process: CPU per second of keeping ``leases`` leases alive."""
    from elastic_rm.etcd import keepalive
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.etcd.lease import KeptLease
    from elastic_rm.etcd.server import EtcdServer

    if batch_ahead is not None:
        keepalive.BATCH_AHEAD = batch_ahead
    server = EtcdServer().start()
    clients, kept = [], []
    try:
        clients = [EtcdClient(server.endpoint, timeout=10) for _ in range(leases)]
        kept = [KeptLease(c, ttl) for c in clients]
        time.sleep(2 * ttl)  # first refreshes, and the batches settle
        cpu0, t0 = sum(os.times()[:2]), time.monotonic()
        time.sleep(seconds)
        cpu1, t1 = sum(os.times()[:2]), time.monotonic()
        return {
            "cores": (cpu1 - cpu0) / (t1 - t0),
            "max_gap_s": max(k.max_gap for k in kept),
            "lost": sum(k.lost for k in kept),
            "streams": keepalive.STREAMS["opened"],
        }
    finally:
        for k in kept:
            k.revoke()
        for c in clients:
            c.close()
        server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--leases", type=int, default=128, help="leases (and clients) in the process")
    p.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds (the default lease_ttl)")
    p.add_argument("--seconds", type=float, default=20.0, help="measured time per trial and variant")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--child", default="", help=argparse.SUPPRESS)  # a variant, in its own process
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args.leases, args.seconds, args.ttl, VARIANTS[args.child])))
        return
    results: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for trial in range(args.trials):
        order = list(VARIANTS) if trial % 2 == 0 else list(reversed(VARIANTS))
        for variant in order:
            argv = [
                sys.executable,
                "-m",
                "benchmarks.keepalive",
                "--child",
                variant,
                "--leases",
                str(args.leases),
                "--ttl",
                str(args.ttl),
                "--seconds",
                str(args.seconds),
            ]
            out = subprocess.run(
                argv, capture_output=True, text=True, timeout=args.seconds + 10 * args.ttl + 120
            )
            if out.returncode != 0:
                raise SystemExit(f"{variant} trial failed:\n{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1]) | {"load_avg": os.getloadavg()}
            results[variant].append(row)
            print(
                f"trial {trial} {variant:<9} {row['cores'] * 100:.2f}% of a core, longest refresh gap "
                f"{row['max_gap_s']:.2f} s, {row['lost']} lost",
                flush=True,
            )
    summary = {
        v: {
            "cores": summarize([r["cores"] for r in rows]),
            "max_gap_s": max(r["max_gap_s"] for r in rows),
            "lost": sum(r["lost"] for r in rows),
        }
        for v, rows in results.items()
    }
    ratio = summary["batched"]["cores"]["median"] / summary["per-lease"]["cores"]["median"]
    print(f"batched / per-lease CPU: {ratio:.2f}")
    path = write_result(
        "keepalive",
        {"config": vars(args), "trials": results, "summary": summary, "cores_batched_vs_per_lease": ratio},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
