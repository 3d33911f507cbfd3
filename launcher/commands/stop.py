"""`erm stop RUN`: stop a run cleanly; `erm stop RUN --node N`: take one node down (docs/operate.md)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

from launcher.commands.status import UsageError, add_etcd_security_arguments, connect, no_run, seconds

HELP = "Stop a run: drain, final checkpoint, close, every agent exits 0 (--node N: take one node down)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", metavar="RUN", help="the run's --rdzv-id")
    p.add_argument("--endpoint", required=True, help="etcd endpoint(s), host:port[,host:port...]")
    p.add_argument(
        "--node",
        metavar="N",
        help="take only node N down: its agent (on this machine) gets SIGTERM and leaves the run, which "
        "goes on with the other nodes",
    )
    p.add_argument(
        "--wait",
        type=float,
        default=120.0,
        help="seconds to wait for the agents to leave (default 120; 0: do not wait)",
    )
    p.add_argument("--prefix", default="/elastic-rm", help="etcd key prefix (default /elastic-rm)")
    p.add_argument("--timeout", type=seconds, default=5.0, help="seconds for each etcd call (default 5)")
    add_etcd_security_arguments(p)


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.wire.keyspace import Keyspace
    from elastic_rm.wire.records import RecordError

    try:
        if not args.wait >= 0:
            raise UsageError(f"--wait must be >= 0 seconds, got {args.wait:g}")
        keys = Keyspace(args.prefix, args.run)
        with connect(args) as client:
            _check_run(client, keys)
            if args.node is not None:
                return _stop_node(client, keys, args.node, args.wait)
            return _stop_run(client, keys, args.wait)
    except RecordError as exc:  # the named node's record is not what an agent writes
        print(f"erm stop: error: {_malformed(exc)}", file=sys.stderr)
        return 2
    except (EtcdError, ValueError, UsageError) as exc:
        print(f"erm stop: error: {exc}", file=sys.stderr)
        return 2


def _malformed(exc: Exception) -> str:
    """A RecordError's message (it names the key), saying what to do about it."""
    text = str(exc)
    return text if "delete or fix" in text else f"{text}; delete or fix the key"


def _check_run(client, keys) -> None:
    if client.get(keys.round) is None and not client.get_prefix(keys.nodes)[0]:
        raise no_run(client, keys)


def _registered(client, keys) -> list[str]:
    """The ids of every key under ``nodes/``, malformed or not."""
    return sorted(keys.node_of(kv.key) for kv in client.get_prefix(keys.nodes)[0])


def _nodes(client, keys) -> tuple[list[str], list[str]]:
    """The nodes of the run, and the messages of the keys under ``nodes/`` that are no node record."""
    from elastic_rm.wire.records import NodeRecord, RecordError

    nodes, malformed = [], []
    for kv in client.get_prefix(keys.nodes)[0]:
        try:
            NodeRecord.parse(kv.key, kv.value)
        except RecordError as exc:
            malformed.append(_malformed(exc))
        else:
            nodes.append(keys.node_of(kv.key))
    return sorted(nodes), malformed


def _wait_gone(client, keys, what: list[str], wait_s: float) -> list[str]:
    """The nodes among ``what`` still registered after ``wait_s`` seconds."""
    deadline = time.monotonic() + wait_s
    left = [n for n in _registered(client, keys) if n in what]
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = [n for n in _registered(client, keys) if n in what]
    return left


def _stop_run(client, keys, wait_s: float) -> int:
    from elastic_rm.agent.stop import STOP_BY
    from elastic_rm.wire.records import ClosedRecord, RecordError, dumps

    closed = client.get(keys.closed)
    by = None
    if closed is not None:
        try:
            by = ClosedRecord.parse(keys.closed, closed.value).by
        except RecordError:  # the agents do not take it for a close: replace it with one
            print(f"erm stop: replacing the malformed value of {keys.closed} (not a close to the agents)")
    if by is not None:
        print(f"erm stop: run {keys.run_id} is already closed (by {by})")
    else:
        client.put(keys.closed, dumps(ClosedRecord(by=STOP_BY, time=time.time(), outcome="stopped")))
        print(f"erm stop: run {keys.run_id} closed; its agents drain their workers and exit")
    nodes, malformed = _nodes(client, keys)
    for text in malformed:
        print(f"erm stop: not waiting for a key that is no node record: {text}", file=sys.stderr)
    if wait_s == 0 or not nodes:
        return 0
    left = _wait_gone(client, keys, nodes, wait_s)
    if left:
        print(f"erm stop: still running after {wait_s:g}s: {', '.join(left)}", file=sys.stderr)
        return 1
    print(f"erm stop: run {keys.run_id} stopped: {len(nodes)} node(s) left ({', '.join(nodes)})")
    return 0


def _stop_node(client, keys, node: str, wait_s: float) -> int:
    from elastic_rm.wire.records import NodeRecord

    kv = client.get(keys.node(node))
    if kv is None:
        raise UsageError(
            f"no node {node!r} in run {keys.run_id} (nodes: {', '.join(_nodes(client, keys)[0]) or 'none'})"
        )
    rec = NodeRecord.parse(kv.key, kv.value)
    here = socket.gethostname()
    if rec.host != here:
        raise UsageError(
            f"node {node} runs on host {rec.host}, not here ({here}): run this command there, or send its "
            f"agent SIGTERM there (kill -TERM {rec.pid})"
        )
    try:
        os.kill(rec.pid, signal.SIGTERM)
    except ProcessLookupError:
        raise UsageError(
            f"node {node}'s agent (pid {rec.pid}) is gone; its lease expires by itself"
        ) from None
    print(f"erm stop: sent SIGTERM to node {node}'s agent (pid {rec.pid})")
    if not wait_s:
        print(
            f"erm stop: asked node {node} to leave run {keys.run_id} (--wait 0: not waiting to see it leave)"
        )
        return 0
    if _wait_gone(client, keys, [node], wait_s):
        print(f"erm stop: node {node} still registered after {wait_s:g}s", file=sys.stderr)
        return 1
    print(f"erm stop: node {node} left run {keys.run_id}; the other nodes go on without it")
    return 0
