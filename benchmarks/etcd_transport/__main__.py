"""etcd transports: gRPC (every process) against etcd's JSON gateway (a process forked while gRPC was up).

Decides where the gateway is used: if it were as fast as gRPC, one transport everywhere would be simpler.
The same sequence of calls runs against one etcd in alternating rounds (so that a change in the
machine's load hits both alike): in this process over gRPC (the baseline), then in a child forked while
this process holds a client open, which the facade sends over the gateway. Per operation it reports the
median and 90th percentile latency of one call and the ratio gateway / gRPC of the medians. The child
reports over a pipe as JSON. Writes benchmarks/results/etcd_transport.json.

Run: ``python -m benchmarks.etcd_transport --calls 300 --rounds 5``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from benchmarks.common import write_result
from elastic_rm.etcd.client import Compare, EtcdClient, Op
from elastic_rm.etcd.server import EtcdServer

OPS = ("put", "get", "txn", "get_prefix_100", "watch_event")


def measure(endpoint: str, prefix: str, calls: int) -> dict:
    """Seconds per call of each operation, over one client."""
    out: dict[str, list[float]] = {op: [] for op in OPS}
    with EtcdClient(endpoint, timeout=5) as c:
        for i in range(100):
            c.put(f"{prefix}/many/{i:03d}", "v" * 64)
        seen: list = []
        cancel = c.watch_prefix(f"{prefix}/w", c.ping() + 1, seen.extend, exact=True)
        for i in range(calls):
            for op, call in (
                ("put", lambda i=i: c.put(f"{prefix}/k", str(i))),
                ("get", lambda: c.get(f"{prefix}/k")),
                (
                    "txn",
                    lambda i=i: c.txn([Compare.absent(f"{prefix}/none")], [Op.put(f"{prefix}/t", str(i))]),
                ),
                ("get_prefix_100", lambda: c.get_prefix(f"{prefix}/many/")),
            ):
                started = time.perf_counter()
                call()
                out[op].append(time.perf_counter() - started)
            started = time.perf_counter()
            c.put(f"{prefix}/w", str(i))
            while len(seen) <= i:  # bounded by the watch delivering, or the deadline below
                if time.perf_counter() - started > 5:
                    raise TimeoutError("the watch did not deliver within 5 s")
                time.sleep(0.0002)
            out["watch_event"].append(time.perf_counter() - started)
        cancel()
        transport = c.transport
    return {"transport": transport, **out}


def stats(values: list[float]) -> dict:
    ordered = sorted(values)
    return {
        "n": len(values),
        "median_ms": round(statistics.median(values) * 1000, 3),
        "p90_ms": round(ordered[int(len(ordered) * 0.9)] * 1000, 3),
    }


def in_forked_child(endpoint: str, prefix: str, calls: int) -> dict:
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write JSON, leave without running the parent's cleanup
        os.close(read_fd)
        code = 0
        try:
            payload = measure(endpoint, prefix, calls)
        except Exception as exc:  # noqa: BLE001 - reported to the parent as data
            payload, code = {"error": f"{type(exc).__name__}: {exc}"}, 1
        with os.fdopen(write_fd, "w") as fh:
            json.dump(payload, fh)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as fh:
        data = fh.read()
    _, status = os.waitpid(pid, 0)
    result = json.loads(data) if data else {"error": f"child ended with status {status} and no answer"}
    if "error" in result:
        raise SystemExit(f"the forked child failed: {result['error']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=300, help="calls of each operation per transport")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    samples: dict[str, dict[str, list[float]]] = {
        "grpc": {op: [] for op in OPS},
        "gateway": {op: [] for op in OPS},
    }
    per_round = max(1, args.calls // args.rounds)
    with EtcdServer() as server:
        for r in range(args.rounds):
            got = measure(server.endpoint, f"/bench/grpc{r}", per_round)
            with EtcdClient(server.endpoint, timeout=5) as held:  # gRPC up here while forking
                held.put("/bench/held", "x")
                forked = in_forked_child(server.endpoint, f"/bench/gateway{r}", per_round)
            assert got["transport"] == "grpc" and forked["transport"] == "gateway"
            for name, result in (("grpc", got), ("gateway", forked)):
                for op in OPS:
                    samples[name][op].extend(result[op])
    grpc_result = {op: stats(samples["grpc"][op]) for op in OPS}
    gateway_result = {op: stats(samples["gateway"][op]) for op in OPS}
    ratios = {op: round(gateway_result[op]["median_ms"] / grpc_result[op]["median_ms"], 2) for op in OPS}
    print(f"{'operation':16} {'gRPC median':>12} {'gateway median':>15} {'ratio':>6}")
    for op in OPS:
        g, w = grpc_result[op]["median_ms"], gateway_result[op]["median_ms"]
        print(f"{op:16} {g:>9.2f} ms {w:>12.2f} ms {ratios[op]:>6.2f}")
    path = write_result(
        "etcd_transport",
        {
            "calls": per_round * args.rounds,
            "rounds": args.rounds,
            "grpc": grpc_result,
            "gateway": gateway_result,
            "ratio_gateway_over_grpc": ratios,
            "load_avg_before": load_before,
            "load_avg_after": os.getloadavg(),
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
