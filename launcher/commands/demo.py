"""`erm demo`: scale-up, node failure and recovery of a TorchRec DLRM job on this machine, watched live."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time

HELP = "Run a whole elastic job on this machine: scale-up, a killed node, recovery; then a summary."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", help="where logs, checkpoints and the summary go (default: a new temp dir)")
    p.add_argument(
        "--phase-timeout", type=float, default=120.0, help="seconds each phase may take (default 120)"
    )
    p.add_argument("--hold", type=float, default=8.0, help="seconds to train in each phase (default 8)")
    p.add_argument("--no-live", action="store_true", help="plain log lines instead of the live view")


def _view(demo, rows, phase: str):
    from rich.console import Group
    from rich.table import Table

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
        events.add_row(time.strftime("%H:%M:%S", time.localtime(e["t"])), e["text"])
    return Group(table, events)


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.server import EtcdServer
    from elastic_rm.train.paths import run_memory_dir
    from launcher.demo import DEFAULT_SCRIPT, Demo, new_workdir, rounds_from_etcd, summarize, world_reached

    if not os.path.isfile(DEFAULT_SCRIPT):
        print(f"erm demo: error: the example {DEFAULT_SCRIPT} is missing", file=sys.stderr)
        return 2
    workdir = args.workdir or new_workdir()
    os.makedirs(workdir, exist_ok=True)
    demo = Demo(workdir=workdir, script=DEFAULT_SCRIPT, script_args=[])
    live = None
    phase = "starting"
    t_begin = time.time()

    def refresh(rows):
        if live is not None:
            live.update(_view(demo, rows, phase))

    def wait_for(predicate, what: str) -> None:
        deadline = time.time() + args.phase_timeout
        while time.time() < deadline:
            rows = demo.progress()
            refresh(rows)
            if predicate(rows):
                return
            time.sleep(0.25)
        raise TimeoutError(f"{what} did not happen within {args.phase_timeout:.0f}s; logs in {workdir}")

    def hold(seconds: float) -> None:
        end = time.time() + seconds
        while time.time() < end:
            refresh(demo.progress())
            time.sleep(0.25)

    def say(kind: str, text: str) -> None:
        demo.event(kind, text)
        if live is None:
            print(f"[erm demo] {text}", flush=True)

    etcd = EtcdServer().start()
    try:
        if not args.no_live and sys.stdout.isatty():
            from rich.live import Live

            live = Live(refresh_per_second=4)
            live.start()
        say("etcd", f"embedded etcd at {etcd.endpoint}; run {demo.run_id}; workdir {workdir}")
        phase = "world 2"
        for name in ("node-a", "node-b"):
            demo.start_node(name, etcd.endpoint)
        t0 = time.time()
        wait_for(lambda rows: world_reached(rows, 2, t0), "training at world 2")
        say("round", "training at world 2")
        hold(args.hold)

        phase = "scale-up"
        t_up = time.time()
        demo.start_node("node-c", etcd.endpoint)
        say("node", "node-c arrives: the leader admits it in a new round")
        wait_for(lambda rows: world_reached(rows, 3, t_up), "training at world 3")
        say("round", f"training at world 3, {time.time() - t_up:.1f}s after node-c started")
        hold(args.hold)

        phase = "failure"
        victim = demo.nodes["node-b"]
        victim.signal(signal.SIGKILL)
        victim.killed = t_kill = time.time()
        say("fault", "node-b killed with SIGKILL")
        wait_for(lambda rows: world_reached(rows, 2, t_kill), "survivors training at world 2")
        say("round", f"survivors training at world 2, {time.time() - t_kill:.1f}s after the kill")
        hold(args.hold)

        phase = "stopping"
        open(os.path.join(demo.progress_dir, "stop"), "w").close()
        say("stop", "asking the job to stop")
        for name, node in demo.nodes.items():
            if node.killed is None:
                try:
                    node.proc.wait(args.phase_timeout)
                except Exception:  # noqa: BLE001 - stop_all below ends it
                    say("stop", f"{name} did not exit in time; stopping it")
        rounds = rounds_from_etcd(etcd.endpoint, demo.run_id)
    except (TimeoutError, KeyboardInterrupt) as exc:
        if live is not None:
            live.stop()
            live = None
        print(f"erm demo: {exc or 'interrupted'}", file=sys.stderr)
        return 1
    finally:
        if live is not None:
            live.stop()
        demo.stop_all()
        etcd.stop()
        shutil.rmtree(run_memory_dir(demo.run_id), ignore_errors=True)  # the killed node's copies too

    summary = summarize(demo.progress(), rounds)
    summary["events"] = demo.events
    summary["wall_s"] = time.time() - t_begin
    with open(os.path.join(workdir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    _print_summary(summary, workdir)
    try:
        from elastic_rm.obs.timeline import plot_demo

        png = plot_demo(demo.progress(), demo.events, os.path.join(workdir, "timeline.png"))
        print(f"timeline: {png}")
    except ImportError:
        pass
    ok = {2, 3} <= set(summary["throughput"])
    return 0 if ok else 1


def _print_summary(summary: dict, workdir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    rounds = Table(title="rounds (from etcd)")
    for col in ("round", "members", "reason"):
        rounds.add_column(col)
    for r in summary["rounds"]:
        rounds.add_row(
            str(r.get("round")), ", ".join(r.get("members", [])), r.get("reason", r.get("error", ""))
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
            f"(embedding checksum after the restore {r.get('checksum', '-')})"
        )
    console.print(f"total {summary['wall_s']:.0f}s; logs and summary.json in {workdir}")
