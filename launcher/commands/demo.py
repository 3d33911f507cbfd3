"""`erm demo`: a TorchRec DLRM job on this machine run by the planner through a scale-up, a straggler and a
node failure, watched live; a summary with checks at the end."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time

HELP = (
    "Run a whole elastic job on this machine: a planned scale-up, a straggler replaced, a killed node; "
    "then a summary."
)


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
    from elastic_rm.agent import cgroup as cg
    from elastic_rm.etcd.server import EtcdServer
    from elastic_rm.train.paths import remove_node_memory, run_memory_dir
    from launcher.demo import (
        DEFAULT_JOB,
        DEFAULT_SCRIPT,
        Demo,
        checks,
        decisions_from_etcd,
        new_workdir,
        outcomes_from_etcd,
        restarted_at,
        rounds_from_etcd,
        summarize,
        world_reached,
    )

    if not os.path.isfile(DEFAULT_SCRIPT):
        print(f"erm demo: error: the example {DEFAULT_SCRIPT} is missing", file=sys.stderr)
        return 2
    workdir = args.workdir or new_workdir()
    os.makedirs(workdir, exist_ok=True)
    # a reused workdir: an old run's progress (and its stop file) would end this one at once
    shutil.rmtree(os.path.join(workdir, "progress"), ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "ckpt"), ignore_errors=True)
    layout = cg.detect()
    agent_args = ["--job", DEFAULT_JOB]
    if layout is not None:  # each node in a cgroup of its own (no quota yet), so one can be slowed down
        agent_args += ["--cpu-limit", str(os.cpu_count() or 1)]
    demo = Demo(workdir=workdir, script=DEFAULT_SCRIPT, script_args=[], nnodes="1:3", agent_args=agent_args)
    live = None
    phase = "starting"
    t_begin = time.time()

    def refresh(rows):
        if live is not None:
            live.update(_view(demo, rows, phase))

    def wait_for(predicate, what: str):
        deadline = time.time() + args.phase_timeout
        while time.time() < deadline:
            rows = demo.progress()
            refresh(rows)
            value = predicate(rows)
            if value:
                return value
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

    def decided(since: float, words: str):
        return lambda _rows: [
            d
            for d in decisions_from_etcd(etcd.endpoint, demo.run_id)
            if d["t"] >= since and words in d["reason"]
        ]

    etcd = EtcdServer().start()
    throttled = None
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
        say("round", "training at world 2 (the planner's cold start for the job's request)")
        hold(args.hold)

        phase = "scale-up"
        t_up = time.time()
        demo.start_node("node-c", etcd.endpoint)
        say("node", "node-c arrives: the planner profiles world 2, then decides whether a third node pays")
        d = wait_for(decided(t_up, "scale up"), "the planner's scale-up decision")[0]
        say("decision", f"round {d['round']}: {d['reason']}")
        wait_for(lambda rows: world_reached(rows, 3, t_up), "training at world 3")
        say("round", f"training at world 3, {time.time() - t_up:.1f}s after node-c started")
        hold(args.hold)

        if layout is not None:
            phase = "straggler"
            demo.start_node("node-d", etcd.endpoint)
            say("node", "node-d arrives and waits as the standby (the job is at its maximum of 3)")
            hold(args.hold)
            victim = "node-b"
            throttled = cg.NodeCgroup(layout, f"{demo.run_id}.{victim}")
            throttled.set_cpu(0.1)
            t_slow = time.time()
            say("fault", f"{victim} throttled to 0.1 CPU (its cgroup's quota): a straggler")
            d = wait_for(decided(t_slow, "straggler"), "the straggler's replacement")[0]
            say(
                "decision",
                f"round {d['round']}: {d['reason']} ({time.time() - t_slow:.1f}s after the throttle)",
            )
            world = len(d["members"])
            wait_for(lambda rows: restarted_at(rows, world, d["t"]), f"training again at world {world}")
            hold(args.hold)
        else:
            say("skip", "no writable cgroup here (needs root): the straggler phase is skipped")

        phase = "failure"
        members = rounds_from_etcd(etcd.endpoint, demo.run_id)[-1]["members"]
        victim = members[-1]  # a member: its loss needs a new round
        victim_node = demo.nodes[victim]
        victim_node.signal(signal.SIGKILL)
        victim_node.killed = t_kill = time.time()
        remove_node_memory(demo.run_id, victim)  # a dead machine's memory is gone with it
        say("fault", f"{victim} killed with SIGKILL (and its node memory removed)")
        world = len(members) - 1
        wait_for(lambda rows: restarted_at(rows, world, t_kill), f"survivors training at world {world}")
        say("round", f"survivors training at world {world}, {time.time() - t_kill:.1f}s after the kill")
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
        outcomes = outcomes_from_etcd(etcd.endpoint, demo.run_id)
        for r in rounds:
            o = outcomes.get(r.get("round"), {})
            r["predicted_gain"], r["measured_gain"] = o.get("predicted_gain"), o.get("measured_gain")
    except (TimeoutError, KeyboardInterrupt) as exc:
        if live is not None:
            live.stop()
            live = None
        print(f"erm demo: {exc or 'interrupted'}", file=sys.stderr)
        return 1
    finally:
        if live is not None:
            live.stop()
        if throttled is not None and throttled.cpu_dir.exists():  # gone when its node exited
            throttled.set_cpu(None)
        demo.stop_all()
        etcd.stop()
        shutil.rmtree(run_memory_dir(demo.run_id), ignore_errors=True)  # the killed node's copies too

    rows = demo.progress()
    summary = summarize(rows, rounds)
    summary["checks"] = checks(rows)
    summary["events"] = demo.events
    summary["wall_s"] = time.time() - t_begin
    with open(os.path.join(workdir, "summary.json"), "w") as fh:
        json.dump(summary, fh, indent=2)
    from elastic_rm.obs.results_file import write_demo_results

    print(f"figures: {write_demo_results(summary) or 'not written (no benchmarks/results/ in this install)'}")
    _print_summary(summary, workdir)
    try:
        from elastic_rm.obs.timeline import plot_demo

        png = plot_demo(rows, demo.events, os.path.join(workdir, "timeline.png"))
        print(f"timeline: {png}")
    except ImportError:
        pass
    ok = {2, 3} <= set(summary["throughput"]) and all(c["ok"] for c in summary["checks"])
    return 0 if ok else 1


def _print_summary(summary: dict, workdir: str) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
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
