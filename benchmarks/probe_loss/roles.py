"""The two processes of the probe-loss benchmark, each run inside a host's network namespace:
``listen`` (a checkpoint server's port: accept and close) and ``probe`` (the peer probe's own connects,
``probe_outcomes``, back to back at each timeout; prints one JSON line per probe). Both end by themselves
(``--for-s``, ``--probes``) and are also stopped by their pid."""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

from elastic_rm.rendezvous.peer_sockets import OK, probe_outcomes


def listen(port: int, for_s: float) -> None:
    deadline = time.monotonic() + for_s
    with socket.create_server(("0.0.0.0", port), backlog=64, reuse_port=False) as server:
        server.settimeout(0.5)
        print("listening", flush=True)
        while time.monotonic() < deadline:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            conn.close()


def probe(targets: dict[str, tuple[str, int]], probes: int, timeouts: list[float]) -> None:
    """Per probe, per timeout: {"timeout_s", "duration_s", "lost": [peers whose connect failed]}."""
    for _ in range(probes):
        for timeout_s in timeouts:
            t0 = time.monotonic()
            outcomes = probe_outcomes(targets, timeout_s)
            lost = sorted(n for n, outcome in outcomes.items() if outcome != OK)
            row = {"timeout_s": timeout_s, "duration_s": round(time.monotonic() - t0, 4), "lost": lost}
            sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_loss.roles")
    sub = p.add_subparsers(dest="role", required=True)
    lp = sub.add_parser("listen")
    lp.add_argument("--port", type=int, required=True)
    lp.add_argument("--for-s", type=float, required=True)
    pp = sub.add_parser("probe")
    pp.add_argument("--target", action="append", required=True, metavar="NODE=ADDR:PORT")
    pp.add_argument("--probes", type=int, required=True)
    pp.add_argument("--timeouts", type=float, nargs="+", required=True)
    args = p.parse_args()
    if args.role == "listen":
        listen(args.port, args.for_s)
    else:
        targets = {}
        for spec in args.target:
            node, _, addr_port = spec.partition("=")
            addr, _, port = addr_port.rpartition(":")
            targets[node] = (addr, int(port))
        probe(targets, args.probes, args.timeouts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
