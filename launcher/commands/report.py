"""`erm report RUN`: a PNG and a self-contained HTML page of a run's timeline and decisions."""

from __future__ import annotations

import argparse
import sys

from .status import UsageError, add_etcd_security_arguments, check_run, connect, resolve_run, seconds

HELP = "Write a PNG and an HTML page of a run: world size, throughput, utilisation, decisions."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "run",
        metavar="RUN",
        nargs="?",
        help="the run id (the job's --rdzv-id; default: the only run under the prefix, or in the files)",
    )
    p.add_argument("--run-id", help="the same as RUN, as erm status, top and events take it")
    p.add_argument("--endpoint", help="etcd endpoint(s): the run's events and round records")
    p.add_argument("--prefix", default="/elastic-rm", help="etcd key prefix (default /elastic-rm)")
    p.add_argument(
        "--events",
        action="append",
        default=[],
        metavar="FILE",
        help="an --event-log file (repeatable; merged with etcd's copy without duplicates)",
    )
    p.add_argument("-o", "--out-dir", default=".", help="directory for RUN.png and RUN.html (default: .)")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds for each etcd call (default 5)")
    p.add_argument(
        "--all-events",
        action="store_true",
        help="list the periodic 'sample' and 'checkpoint' events in the events table too",
    )
    add_etcd_security_arguments(p)


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.obs.run_report import error_histogram, load_run, write_report
    from elastic_rm.wire.keyspace import Keyspace

    if not args.endpoint and not args.events:
        print("erm report: error: pass --endpoint (etcd) and/or --events FILE", file=sys.stderr)
        return 2
    if args.run is not None and args.run_id is not None and args.run != args.run_id:
        print(f"erm report: error: RUN {args.run!r} and --run-id {args.run_id!r} differ", file=sys.stderr)
        return 2
    args.run = args.run if args.run is not None else args.run_id  # docs/operate.md: --run-id, as status
    try:
        if args.endpoint:
            with connect(args) as client:
                if args.run is None and not args.events:
                    args.run = resolve_run(client, args.prefix, None)
                elif args.run is None:
                    args.run = _only_run(args.events)
                data = load_run(args.run, client, args.prefix, tuple(args.events))
                if not args.events and not data.events and not data.decisions:
                    check_run(client, Keyspace(args.prefix, args.run))  # names the runs there
        else:
            if args.run is None:
                args.run = _only_run(args.events)
            data = load_run(args.run, None, args.prefix, tuple(args.events))
        for message in data.errors:  # before "nothing recorded" too: a file of malformed lines said why
            print(f"erm report: malformed (skipped): {message}", file=sys.stderr)
        if not data.events and not data.decisions:
            print(
                f"erm report: error: nothing recorded for run {args.run!r} (check RUN, --endpoint, "
                "--prefix and --events)",
                file=sys.stderr,
            )
            return 2
        png, page, labels = write_report(data, args.out_dir, all_events=args.all_events)
    except (EtcdError, ValueError, OSError, UsageError) as exc:
        print(f"erm report: error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(data.decisions)} decision(s), {len(data.events)} event(s)")
    hist = [(label, n) for label, n in error_histogram(data.decisions) if n]
    if hist:
        print("prediction error (predicted - measured gain): " + ", ".join(f"{lb}: {n}" for lb, n in hist))
    print(f"picture: {png}")
    print(f"page:    {page}")
    return 0


def _only_run(files: list[str]) -> str:
    """The run of the events in ``files`` when they hold one run; else a UsageError naming the runs."""
    from elastic_rm.obs.events import Event, read_file

    runs = sorted({e.run for path in files for e in read_file(path) if isinstance(e, Event)})
    if len(runs) != 1:
        raise UsageError(f"pass RUN (runs in the files: {', '.join(runs) or 'none'})")
    return runs[0]
