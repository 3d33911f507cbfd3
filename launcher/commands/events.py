"""`erm events`: print or follow a run's event log, from etcd (all nodes, compacted) or from a node's
``--event-log`` file (complete for that node). Following etcd is a watch, not polling."""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

from .status import UsageError, add_connection_arguments, check_run, connect, reader_gone, resolve_run

HELP = "Print or follow a run's event log (rounds, decisions, failures, drains, job start/end)."
FILE_POLL_S = 0.5  # --follow --file: how often to look for new lines (a file has no watch)
RUN_OVER_POLL_S = 0.5  # --follow: how often to look whether the run is closed and every node left


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p, endpoint_required=False)
    p.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="F",
        help="read this --event-log file instead of etcd (repeatable: files are merged)",
    )
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events (Ctrl-C to stop)")
    p.add_argument("--json", action="store_true", help="one JSON event per line, as written")
    p.add_argument(
        "--kind",
        action="append",
        default=[],
        help="only events of this kind (repeatable); default: all but the periodic 'sample' "
        "and 'checkpoint' (--all-events: every kind)",
    )
    p.add_argument("--all-events", action="store_true", help="every kind, the periodic ones included")


def format_event(e, as_json: bool) -> str:
    if as_json:
        return e.to_json()
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.time)) + f".{int(e.time * 1000) % 1000:03d}"
    return f"{stamp} {e.node or '-':<16} {e.kind:<9} {e.message}"


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.errors import EtcdError

    kinds = set(args.kind)
    from elastic_rm.obs.events import KINDS

    unknown = kinds - set(KINDS)
    if unknown:
        print(
            f"erm events: error: unknown kind(s) {sorted(unknown)}; known: {', '.join(KINDS)}",
            file=sys.stderr,
        )
        return 2
    from elastic_rm.obs.events import PERIODIC_KINDS

    if kinds:
        wanted = lambda e: e.kind in kinds  # noqa: E731
    else:
        wanted = lambda e: args.all_events or e.kind not in PERIODIC_KINDS  # noqa: E731

    # a file may hold several runs' events (an --event-log is appended to): --run-id picks one there,
    # as erm report does; etcd's copy is the run's alone
    one_run = args.run_id if args.file else None

    def show(e) -> None:
        if wanted(e) and (one_run is None or e.run == one_run):
            print(format_event(e, args.json), flush=True)

    def bad(message: str) -> None:
        print(f"erm events: malformed: {message}", file=sys.stderr, flush=True)

    try:
        if args.file:
            return _from_files(args, show, bad)
        if not args.endpoint:
            raise UsageError("pass --endpoint (etcd) or --file (a node's --event-log)")
        return _from_etcd(args, show, bad)
    except BrokenPipeError:  # erm events | head -1
        return reader_gone()
    except (EtcdError, ValueError, UsageError, OSError) as exc:
        print(f"erm events: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0


def _from_etcd(args, show, bad) -> int:
    from elastic_rm.obs.events import follow_etcd, read_etcd
    from elastic_rm.wire.keyspace import Keyspace

    with connect(args) as client:
        keys = Keyspace(args.prefix, resolve_run(client, args.prefix, args.run_id))
        events, errors, revision = read_etcd(client, keys)
        if not events and not errors:
            check_run(client, keys)  # a run id that is not there: say so, do not wait for it forever
        for message in errors:
            bad(message)
        for e in events:
            show(e)
        if not args.follow:
            return 0
        lock = threading.Lock()  # the watch calls back on the client's thread
        gone = threading.Event()  # stdout's reader left (erm events --follow | head -1)

        def on_event(e) -> None:
            with lock:
                if gone.is_set():
                    return
                try:
                    show(e)
                except BrokenPipeError:
                    gone.set()

        def on_error(message: str) -> None:
            with lock:
                bad(message)

        cancel = follow_etcd(client, keys, revision + 1, on_event, on_error)
        try:
            while not gone.is_set() and not _run_over(client, keys):  # or Ctrl-C (KeyboardInterrupt)
                time.sleep(RUN_OVER_POLL_S)  # timed: a Ctrl-C on any thread ends it
            time.sleep(RUN_OVER_POLL_S)  # the watch delivers what came before the last node left
        finally:
            cancel()
        if gone.is_set():
            raise BrokenPipeError  # as when the main thread writes: run() leaves quietly
        print(f"erm events: run {keys.run_id} closed and every node left", file=sys.stderr, flush=True)
    return 0


def _run_over(client, keys) -> bool:
    """The run is closed and no node is in it any more: no event will come."""
    return client.get(keys.closed) is not None and not client.get_prefix(keys.nodes)[0]


def _from_files(args, show, bad) -> int:
    from elastic_rm.obs.events import EventError, merge, read_file

    if args.follow and len(args.file) != 1:  # said before the listing, not after it
        raise UsageError("--follow follows one --file")
    events = []
    for path in args.file:
        for item in read_file(path):
            if isinstance(item, EventError):
                bad(str(item))
            else:
                events.append(item)
    for e in merge(events):
        show(e)
    if not args.follow:
        return 0
    from elastic_rm.obs.events import Event

    path = args.file[0]
    with open(path, encoding="utf-8", errors="replace") as f:
        f.seek(0, os.SEEK_END)
        number = sum(1 for _ in open(path, encoding="utf-8", errors="replace"))
        pending = ""
        while True:
            chunk = f.readline()
            if not chunk:
                time.sleep(FILE_POLL_S)
                continue
            pending += chunk
            if not pending.endswith("\n"):
                continue  # a line being written
            number += 1
            line, pending = pending, ""
            if line.strip():
                try:
                    show(Event.parse(f"{path}:{number}", line))
                except EventError as exc:
                    bad(str(exc))
