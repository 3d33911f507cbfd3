"""`erm demo`: a TorchRec DLRM job on this machine run by the planner through a scale-up, a straggler and a
node failure, watched live; a summary with checks at the end."""

from __future__ import annotations

import argparse
import os
import sys
import time

from elastic_rm.output_paths import output_dir_problem

from .status import seconds

HELP = (
    "Run a whole elastic job on this machine: a planned scale-up, a straggler replaced, a killed node; "
    "then a summary."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workdir",
        help="where logs, checkpoints, the summary and demo.json (its figures) go (default: a new temp dir)",
    )
    p.add_argument(
        "--phase-timeout", type=seconds, default=120.0, help="seconds each phase may take (default 120)"
    )
    p.add_argument("--hold", type=seconds, default=8.0, help="seconds to train in each phase (default 8)")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")


def _view(demo, rows, phase: str):
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"elastic-rm demo - {phase}", expand=False)
    for col in ("node", "process", "world", "rank", "step", "samples/s"):
        table.add_column(col)
    now = time.time()
    for name, node in demo.nodes.items():
        mine = [r for r in rows if r.get("node") == name and "step" in r]
        last = mine[-1] if mine else {}
        recent = [r for r in mine if r["t"] > now - 3]
        rate = sum(r.get("samples", 0) for r in recent) / 3 if recent else 0.0
        state = (
            "killed"
            if node.killed
            else ("running" if node.proc.poll() is None else f"exit {node.proc.returncode}")
        )
        table.add_row(
            name,
            state,
            str(last.get("world", "-")),
            str(last.get("rank", "-")),
            str(last.get("step", "-")),
            f"{rate:,.0f}",
        )
    events = Table(show_header=False, box=None)
    for e in demo.events[-8:]:
        # Text: an event names the workdir and the planner's reasons; "[...]" in them is not rich markup
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), Text(e["text"]))
    return Group(table, events)


def run(args: argparse.Namespace) -> int:
    from elastic_rm.demo.harness import DEFAULT_SCRIPT
    from elastic_rm.demo.scenario import Scenario, passed

    if not os.path.isfile(DEFAULT_SCRIPT):
        print(f"erm demo: error: the example {DEFAULT_SCRIPT} is missing", file=sys.stderr)
        return 2
    if args.workdir and (problem := output_dir_problem(args.workdir)):  # before etcd and the nodes start
        print(f"erm demo: error: --workdir {args.workdir}: {problem}", file=sys.stderr)
        return 2
    live = None
    if not args.no_live and sys.stdout.isatty():
        from rich.live import Live

        live = Live(refresh_per_second=4)

    def on_rows(rows: list[dict]) -> None:
        if live is not None:
            live.update(_view(scenario.demo, rows, scenario.phase))

    def on_event(text: str) -> None:
        if live is None:  # the live view shows the events itself
            print(f"[erm demo] {text}", flush=True)

    scenario = Scenario(
        args.workdir,
        args.phase_timeout,
        args.hold,
        on_rows=on_rows,
        on_event=on_event,
    )
    try:
        if live is not None:
            live.start()
        summary = scenario.run()
    except (TimeoutError, KeyboardInterrupt) as exc:
        if live is not None:
            live.stop()
            live = None
        print(f"erm demo: {exc or 'interrupted'}", file=sys.stderr)
        return 1
    except OSError as exc:  # e.g. a file of the workdir could not be written (the workdir is checked above)
        if live is not None:
            live.stop()
            live = None
        print(f"erm demo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if live is not None:
            live.stop()
    print(f"figures: {scenario.results_file}")
    _print_summary(summary, scenario.workdir)
    if scenario.timeline is not None:
        print(f"timeline: {scenario.timeline}")
    return 0 if passed(summary) else 1


def _print_summary(summary: dict, workdir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(markup=False)  # reasons, details and the workdir are text: "[...]" is not markup
    rounds = Table(title="rounds (from etcd); gain = job throughput after / before - 1")
    for col in ("round", "members", "reason", "predicted", "measured"):
        rounds.add_column(col)
    pct = lambda g: "-" if g is None else f"{g:+.0%}"  # noqa: E731
    for r in summary["rounds"]:
        rounds.add_row(
            str(r.get("round")),
            ", ".join(r.get("members", [])),
            r.get("reason", r.get("error", "")),
            pct(r.get("predicted_gain")),
            pct(r.get("measured_gain")),
        )
    console.print(rounds)
    worlds = Table(title="throughput per world size")
    worlds.add_column("world")
    worlds.add_column("samples/s")
    for world, rate in summary["throughput"].items():
        worlds.add_row(str(world), f"{rate:,.0f}")
    console.print(worlds)
    down = Table(title="downtime per change (rank 0: last step before -> first step after)")
    down.add_column("change")
    down.add_column("seconds")
    for d in summary["downtime"]:
        down.add_row(f"{d['from']} -> {d['to']}", f"{d['seconds']:.2f}")
    console.print(down)
    for r in summary["restores"]:
        console.print(
            f"restored at world {r['world']} from step {r['restored_step']} "
            f"(state checksum after the restore {r.get('checksum', '-')})"
        )
    checks = Table(title="checks (rank 0's progress at every restart)")
    for col in ("check", "ok", "detail"):
        checks.add_column(col)
    for c in summary.get("checks", []):
        checks.add_row(c["what"], "yes" if c["ok"] else "NO", c["detail"])
    console.print(checks)
    console.print(f"total {summary['wall_s']:.0f}s; logs and summary.json in {workdir}")
