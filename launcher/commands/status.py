"""`erm status`: what a job is doing and why it changed, from etcd."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Show a job's round, members (resources, step times), leader and last decisions."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="etcd endpoint(s), host:port[,host:port...]")
    p.add_argument("--run-id", help="the job's --rdzv-id (default: the only run under the prefix)")
    p.add_argument("--prefix", default="/elastic-rm", help="etcd key prefix (default /elastic-rm)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds for each etcd call (default 5)")


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.obs.status import job_status, list_runs
    from elastic_rm.rendezvous.keyspace import Keyspace

    try:
        with EtcdClient(args.endpoint, timeout=args.timeout) as client:
            run_id = args.run_id
            if run_id is None:
                runs = list_runs(client, args.prefix)
                if len(runs) != 1:
                    found = ", ".join(runs) or "none"
                    print(
                        f"erm status: error: pass --run-id (runs under {args.prefix}: {found})",
                        file=sys.stderr,
                    )
                    return 2
                run_id = runs[0]
            status = job_status(client, Keyspace(args.prefix, run_id))
    except (EtcdError, ValueError) as exc:
        print(f"erm status: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
    else:
        _print(status)
    return 0


def _print(s: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    state = "closed" if s["closed"] else ("running" if s["complete"] else "forming")
    console.print(
        f"run {s['run']}: round {s['round']} ({state}), world {s['world_size']}, leader {s['leader']}"
    )
    table = Table()
    for col in ("rank", "node", "state", "cpu", "mem", "step p50", "samples/s"):
        table.add_column(col)
    for m in s["members"] + [{**x, "rank": "standby"} for x in s["standby"]]:
        mem = f"{m['mem_used_bytes'] / 2**30:.1f} GiB" if m.get("mem_used_bytes") is not None else "-"
        p50 = f"{m['step_p50_s'] * 1000:.1f} ms" if m.get("step_p50_s") is not None else "-"
        rate = f"{m['samples_per_s']:,.0f}" if m.get("samples_per_s") is not None else "-"
        cpu = f"{m['cpu_util']:.0%}" if m.get("cpu_util") is not None else "-"
        table.add_row(str(m["rank"]), m["node"], m.get("state", "-"), cpu, mem, p50, rate)
    console.print(table)
    for d in s["decisions"]:
        gain = f", predicted gain {d['predicted_gain']:+.0%}" if d.get("predicted_gain") is not None else ""
        console.print(f"round {d['round']}: {len(d['members'])} node(s) - {d['reason']}{gain}")
    for e in s["errors"]:
        console.print(f"[red]malformed:[/red] {e}")
