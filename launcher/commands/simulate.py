"""`erm simulate`: trace-driven simulation of a shared cluster under the static, Optimus-style and our
policy."""

from __future__ import annotations

import argparse
import math
import sys

from elastic_rm.output_paths import output_dir_problem, output_file_problem

from .status import reader_gone

HELP = "Simulate a shared cluster on a job trace under the static, Optimus-style and planner policies."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--trace", help="job trace CSV (schema: docs/planner.md)")
    src.add_argument(
        "--generate", type=int, metavar="N", default=None, help="generate a trace of N jobs (default 300)"
    )
    parser.add_argument("--write-trace", metavar="CSV", help="also write the generated trace here")
    parser.add_argument(
        "--seed", type=int, default=1, help="seed of the trace generator and of injected faults"
    )
    parser.add_argument(
        "--load",
        type=float,
        default=None,
        help="generated trace: requested load / cluster (default: the family's, 0.85)",
    )
    parser.add_argument(
        "--family",
        default="generator",
        help="generated trace: a population of docs/planner.md 'Trace families' (right-sized, comm-bound, "
        "oom-heavy, bursty, low-load, high-load, hetero-gpu, noisy, slow-warmup, history-lies, short, "
        "data-skew, pai-noise; default: generator)",
    )
    parser.add_argument(
        "--policies",
        default="static,optimus,ours",
        help="comma-separated; also the ablations ours-fixed-size, ours-no-queue, ours-call-in and "
        "ours-fixed-size-call-in (docs/planner.md)",
    )
    parser.add_argument("--machines", type=int, default=48)
    parser.add_argument("--cores", type=float, default=96.0, help="cores per machine")
    parser.add_argument("--mem-gib", type=float, default=768.0, help="memory per machine (GiB)")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per machine")
    parser.add_argument("--fail-rate", type=float, default=0.004, help="node failures per node-hour")
    parser.add_argument("--straggler-rate", type=float, default=0.01, help="straggler episodes per node-hour")
    parser.add_argument("--tick", type=float, default=60.0, help="simulation step (s)")
    parser.add_argument("--out", default="erm-sim", help="directory for result.json and the PNG plots")
    parser.add_argument("--no-plots", action="store_true")


def run(args: argparse.Namespace) -> int:
    from elastic_rm.planner.sim.cluster import ClusterSpec
    from elastic_rm.planner.sim.engine import ABLATIONS, POLICIES, Instability
    from elastic_rm.planner.sim.families import FAMILIES
    from elastic_rm.planner.sim.runner import payload, run_policies, table, write_outputs
    from elastic_rm.planner.sim.trace import TraceError, load_trace, write_trace
    from elastic_rm.planner.sim.tracegen import generate

    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    bad = [p for p in policies if p not in POLICIES + ABLATIONS]
    if bad or not policies:
        print(
            f"erm simulate: --policies: unknown {', '.join(bad) or '(none)'}; "
            f"choose from {', '.join(POLICIES + ABLATIONS)}",
            file=sys.stderr,
        )
        return 2
    if args.family not in FAMILIES:
        print(
            f"erm simulate: --family: unknown {args.family!r}; choose from {', '.join(FAMILIES)}",
            file=sys.stderr,
        )
        return 2
    for flag in ("machines", "cores", "mem_gib", "gpus", "tick", "load"):
        value = getattr(args, flag)
        if value is not None and not (math.isfinite(value) and value > 0):  # nan and inf too
            print(f"erm simulate: --{flag.replace('_', '-')} must be a finite number > 0", file=sys.stderr)
            return 2
    for flag in ("fail_rate", "straggler_rate"):  # a negative rate was silently taken as 0
        if not (math.isfinite(getattr(args, flag)) and getattr(args, flag) >= 0):
            print(f"erm simulate: --{flag.replace('_', '-')} must be a finite number >= 0", file=sys.stderr)
            return 2
    if args.seed < 0:  # numpy's generators take no negative seed: a traceback after the trace was read
        print("erm simulate: --seed must be >= 0", file=sys.stderr)
        return 2
    if args.trace:  # flags of a generated trace were silently ignored with a trace file
        given = [f for f, v in (("--write-trace", args.write_trace), ("--load", args.load is not None)) if v]
        given += ["--family"] if args.family != "generator" else []
        if given:
            print(
                f"erm simulate: {', '.join(given)}: for a generated trace, not with --trace", file=sys.stderr
            )
            return 2
    # the output paths before the simulation runs: a bad one is said now, not after minutes of work
    problem = output_dir_problem(args.out)
    if problem:
        print(f"erm simulate: --out {args.out}: {problem}", file=sys.stderr)
        return 2
    if args.write_trace and (problem := output_file_problem(args.write_trace)):
        print(f"erm simulate: --write-trace {args.write_trace}: {problem}", file=sys.stderr)
        return 2
    spec = ClusterSpec(args.machines, args.cores, args.mem_gib, args.gpus)
    inst = Instability(fail_per_node_h=args.fail_rate, straggler_per_node_h=args.straggler_rate)
    try:
        if args.trace:
            jobs, source = load_trace(args.trace), args.trace
        else:
            n = args.generate if args.generate is not None else 300
            if n < 1:
                print("erm simulate: --generate must be >= 1", file=sys.stderr)
                return 2
            load = args.load if args.load is not None else FAMILIES[args.family].load
            jobs, source = (
                generate(n, args.seed, spec, load, family=args.family),
                f"generated(n={n}, seed={args.seed}, load={load}, family={args.family})",
            )
            if args.write_trace:
                try:
                    write_trace(args.write_trace, jobs)
                except OSError as exc:
                    print(
                        f"erm simulate: --write-trace {args.write_trace}: cannot write it: {exc}",
                        file=sys.stderr,
                    )
                    return 1
    except TraceError as exc:
        print(f"erm simulate: {exc}", file=sys.stderr)
        return 2
    too_big = [j.job_id for j in jobs if j.gpus_per_node > spec.gpus]
    if too_big:
        print(
            f"erm simulate: job {too_big[0]} asks for more GPUs per node than a machine has ({spec.gpus})",
            file=sys.stderr,
        )
        return 2
    result = run_policies(jobs, spec, args.seed, policies, inst, args.tick)
    data = payload(result, spec, inst, args.seed, source, len(jobs))
    reader_left = False  # `erm simulate ... | head`: the results are still written
    try:
        print(
            f"{len(jobs)} jobs from {source}; cluster {spec.machines} x "
            f"({spec.cores:g} cores, {spec.mem_gib:g} GiB, {spec.gpus} GPUs)"
        )
        print(
            table(result["summary"], baseline="static" if "static" in policies else policies[0]), flush=True
        )
    except BrokenPipeError:
        reader_left = True
    try:
        paths = write_outputs(result, data, args.out, plots=not args.no_plots)
    except OSError as exc:
        print(f"erm simulate: --out {args.out}: cannot write the results: {exc}", file=sys.stderr)
        return 1
    try:
        if not reader_left:
            for path in paths:
                print(f"wrote {path}", flush=True)
            return 0
    except BrokenPipeError:
        pass
    return reader_gone()
