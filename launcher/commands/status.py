"""`erm status`: what a job is doing and why it changed, from etcd. ``render`` is shared with `erm top`."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.wire.keyspace import Keyspace

HELP = "Show a job's round, members (resources, step times), leader and last decisions."
MEASURED_SHORT = (
    "measured: the leader's outcome record of the round (samples/s after a full step window vs before the "
    "decision); error = predicted - measured (docs/operate.md)"
)


def seconds(text: str) -> float:
    """argparse type: a finite number of seconds > 0 (nan and inf are no timeout)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: a finite number of seconds > 0")
    return value


def add_connection_arguments(p: argparse.ArgumentParser, endpoint_required: bool = True) -> None:
    p.add_argument(
        "--endpoint", required=endpoint_required, help="etcd endpoint(s), host:port[,host:port...]"
    )
    p.add_argument("--run-id", help="the job's --rdzv-id (default: the only run under the prefix)")
    p.add_argument("--prefix", default="/elastic-rm", help="etcd key prefix (default /elastic-rm)")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds for each etcd call (default 5)")
    add_etcd_security_arguments(p)


def add_etcd_security_arguments(p: argparse.ArgumentParser) -> None:
    """ermrun's etcd TLS and authentication flags, for the commands that read a run from etcd."""
    g = p.add_argument_group("etcd TLS and authentication (as ermrun's)")
    g.add_argument("--etcd-cacert", help="CA certificate (PEM) that signed etcd's server certificate")
    g.add_argument("--etcd-cert", help="client certificate (PEM), with --etcd-key")
    g.add_argument("--etcd-key", help="client private key (PEM), with --etcd-cert")
    g.add_argument("--etcd-user", help="etcd user; the password comes from $ELASTIC_RM_ETCD_PASSWORD")


def connect(args: argparse.Namespace) -> Any:
    """An EtcdClient for --endpoint with the TLS and authentication flags."""
    from elastic_rm.etcd.client import EtcdClient, TlsOptions

    password = os.environ.get("ELASTIC_RM_ETCD_PASSWORD") if args.etcd_user else None
    if args.etcd_user and not password:
        raise UsageError("--etcd-user needs the user's password in $ELASTIC_RM_ETCD_PASSWORD")
    tls = TlsOptions(args.etcd_cacert, args.etcd_cert, args.etcd_key)
    return EtcdClient(args.endpoint, timeout=args.timeout, tls=tls, user=args.etcd_user, password=password)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_connection_arguments(p)
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.add_argument(
        "--decisions", type=int, default=5, help="how many of the last decisions to show (default 5)"
    )
    p.add_argument(
        "--all-events",
        action="store_true",
        help="recent events include the periodic 'sample' and 'checkpoint' ones",
    )
    p.add_argument(
        "--members",
        type=int,
        default=MAX_MEMBERS,
        help=f"node rows to show (default {MAX_MEMBERS}; 0: all); the others are counted",
    )


MAX_MEMBERS = 64


class UsageError(Exception):
    """A problem with the command line that the user can fix; printed without a traceback."""


def resolve_run(client: EtcdClient, prefix: str, run_id: str | None) -> str:
    """The run id given, or the only run under the prefix."""
    from elastic_rm.obs.status import list_runs

    if run_id is not None:
        return run_id
    runs = list_runs(client, prefix)
    if len(runs) != 1:
        raise UsageError(f"pass --run-id (runs under {prefix}: {', '.join(runs) or 'none'})")
    return runs[0]


def no_run(client: EtcdClient, keys: Keyspace) -> UsageError:
    """The error for a run id with no key in etcd, naming the runs there (as `erm stop` says it)."""
    from elastic_rm.obs.status import list_runs

    runs = list_runs(client, keys.prefix)
    return UsageError(f"no run {keys.run_id!r} under {keys.prefix} (runs: {', '.join(runs) or 'none'})")


def check_run(client: EtcdClient, keys: Keyspace) -> None:
    """Raise :func:`no_run` unless the run has a key in etcd: a round, a node registered before the first
    round, an event, anything under its prefix."""
    if not client.get_prefix(keys.run)[0]:
        raise no_run(client, keys)


def reader_gone() -> int:
    """Stdout's reader left (``erm status --json | head -1``): no traceback, no message; stdout pointed
    at /dev/null (the flush at exit would fail again) and exit status 1, as Python's documentation on
    SIGPIPE recommends and as rich does when it is the one writing."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # stdout without a file descriptor (a test's StringIO)
        pass
    return 1


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.obs.status import status_from_kvs
    from elastic_rm.wire.keyspace import Keyspace

    try:
        with connect(args) as client:
            keys = Keyspace(args.prefix, resolve_run(client, args.prefix, args.run_id))
            kvs, revision = client.get_prefix(keys.run)
            if not kvs:
                raise no_run(client, keys)
            status = status_from_kvs(
                keys, kvs, revision, decisions=max(0, args.decisions), all_events=args.all_events
            )
    except (EtcdError, ValueError, UsageError) as exc:
        print(f"erm status: error: {exc}", file=sys.stderr)
        return 2
    try:
        if args.json:
            print(json.dumps(status, indent=2, sort_keys=True), flush=True)
        else:
            from rich.console import Console

            Console().print(render(status, max_members=max(0, args.members)))
            sys.stdout.flush()
    except BrokenPipeError:
        return reader_gone()
    return 0


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.0%}"


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _queue_line(s: dict[str, Any]) -> str | None:
    """The cluster's queue, with how old the count is; "unknown" past the bound where the leader ignores
    it (as the leader counts it: its launcher is gone, or its squeue failing)."""
    q = s.get("queue")
    if q is None:
        count = s.get("waiting_nodes")
        return None if count is None else f"cluster queue: other pending jobs wait for {count} node(s)"
    age = "" if q.get("age_s") is None else f" (written {q['age_s']:g} s ago)"
    if q.get("unknown"):
        return (
            f"cluster queue: unknown: its last count, {q['waiting_nodes']} node(s), was written "
            f"{q['age_s']:g} s ago, more than the {q['stale_after_s']:g} s after which the leader ignores "
            "it (is erm launch still running?)"
        )
    return f"cluster queue: other pending jobs wait for {q['waiting_nodes']} node(s){age}"


def render(s: dict, title: str = "", max_members: int = MAX_MEMBERS) -> Any:
    """The status as rich renderables: headline, members, decisions, recent events, malformed records.
    Tables shrink to the console's width (80 columns is the design target). At most ``max_members`` node
    rows (0: all), then a line with the count of the others: rich lays out every row, and a run of a
    thousand nodes would take seconds to draw."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    state = "closed" if s["closed"] else ("running" if s["sealed"] else "forming")
    # a run forming its first round has no round and may have no leader yet: "-", not "None"
    number = "-" if s["round"] is None else s["round"]
    head = Text(
        f"{title}run {s['run']}: round {number} ({state}), world {s['world_size']}, "
        f"leader {s['leader'] or '-'}, {_rate(s.get('samples_per_s'))} samples/s",
        style="bold",
    )
    nodes = Table(expand=False, pad_edge=False)
    for col, just in (
        ("rank", "right"),
        ("node", "left"),
        ("state", "left"),
        ("cpu", "right"),
        ("mem", "right"),
        ("gpu", "right"),
        ("p50", "right"),
        ("samples/s", "right"),
    ):
        nodes.add_column(col, justify=just, overflow="fold")
    rows = s["members"] + [{**x, "rank": "sb"} for x in s["standby"]]
    hidden = len(rows) - max_members if 0 < max_members < len(rows) else 0
    for m in rows[: len(rows) - hidden]:
        own = m.get("mem_node_bytes")  # the node's own memory; older agents report the machine's only
        own = own if own is not None else m.get("mem_used_bytes")
        mem = f"{own / 2**30:.1f}G" if own is not None else "-"
        p50 = f"{m['step_p50_s'] * 1000:.0f}ms" if m.get("step_p50_s") is not None else "-"
        cpu = f"{m['cpu_util']:.0%}" if m.get("cpu_util") is not None else "-"
        utils = [u for u in m.get("gpu_util") or [] if u is not None]
        gpu = f"{sum(utils) / len(utils):.0%}" if utils else ("-" if not m.get("gpus") else "?")
        nodes.add_row(  # Text, not a str: rich would read "[...]" in a value as markup
            str(m["rank"]),
            Text(str(m["node"])),
            Text(str(m.get("state", "-"))),
            cpu,
            mem,
            gpu,
            p50,
            _rate(m.get("samples_per_s")),
        )
    parts: list[Any] = [head, nodes]
    if hidden:
        parts.append(
            Text(f"... and {hidden} more node(s) (--members 0 lists all; --json has all)", style="dim")
        )
    spares = [m for m in s["members"] + s["standby"] if m.get("spares") is not None]
    if spares:
        parts.append(
            Text(
                "warm spares: "
                + ", ".join(
                    f"{m['node']} {m['spares']} ({m['spares_rss_bytes'] / 2**30:.2f}G)" for m in spares
                )
            )
        )
    queue_line = _queue_line(s)
    if queue_line:
        parts.append(Text(queue_line))
    if s.get("data"):
        d = s["data"]
        into = d["samples_done"] - d["epoch"] * d["epoch_samples"]
        parts.append(
            Text(
                f"data: {d['samples_done']:,} samples trained (epoch {d['epoch']}: {into:,} of "
                f"{d['epoch_samples']:,}), as of the checkpoint of step {d['step']}"
            )
        )
    if s["decisions"]:
        # the figures in a table whose cells never wrap; each reason on its own line under it, the whole
        # width for it (a reason column got some 8 characters of an 80-column terminal)
        dec = Table(title="decisions", title_justify="left", expand=False, pad_edge=False)
        for col, just in (
            ("round", "right"),
            ("time", "left"),
            ("world", "right"),
            ("pred.", "right"),
            ("measured", "right"),
            ("error", "right"),
            ("down", "right"),
            ("redone", "right"),
        ):
            dec.add_column(col, justify=just, no_wrap=True)
        reasons = []
        for d in s["decisions"]:
            when = time.strftime("%H:%M:%S", time.localtime(d["time"])) if d.get("time") else "-"
            measured = _pct(d.get("measured_gain"))
            if d.get("measured_gain") is not None:
                measured += f" (vs r{d['compared_to_round']})"
            down = f"{d['downtime_s']:.1f}s" if d.get("downtime_s") is not None else "-"
            redone = str(d["redone_steps"]) if d.get("redone_steps") is not None else "-"
            dec.add_row(
                str(d["round"]),
                when,
                str(len(d["members"])),
                _pct(d.get("predicted_gain")),
                measured,
                _pct(d.get("prediction_error")),
                down,
                redone,
            )
            reasons.append(Text.assemble((f"round {d['round']}: ", "bold"), d["reason"] or "-"))
        parts += [dec, *reasons, Text(MEASURED_SHORT, style="dim")]
    if s.get("events"):
        ev = Table(title="recent events", title_justify="left", show_header=False, box=None, pad_edge=False)
        ev.add_column("time", no_wrap=True)
        ev.add_column("node", overflow="fold")
        ev.add_column("kind", no_wrap=True)
        ev.add_column("message", overflow="fold")
        for e in s["events"]:
            # Text, not a str: a message ("[rank0]: ...", a path "[/tmp/x]") is not rich markup (a closing
            # tag that opens nothing raised MarkupError, and "[rank0]" vanished)
            ev.add_row(
                time.strftime("%H:%M:%S", time.localtime(e["time"])),
                Text(str(e["node"])),
                Text(str(e["kind"])),
                Text(str(e["message"])),
            )
        parts.append(ev)
    for e in s["errors"]:
        parts.append(Text.assemble(("malformed: ", "red"), e))
    return Group(*parts)
