"""Many simulated nodes in one process for the scale benchmark: real rendezvous handlers (through torch's
registry), each doing what a node's agent does to the control plane, without training workers.

Per node, as ``ElasticRMAgent`` does: ``next_rendezvous()``; then ``num_nodes_waiting()`` every 0.1 s
(torch's monitor interval) and a new ``next_rendezvous()`` when it is positive; a metrics record a second
through ``services.publish_metrics`` (the agent's record, with a few percent of noise on a steady load);
a "sample" event every ``--event-sample-interval`` seconds through the node's event log. With
``--ckpt-ports``, each node also serves a checkpoint port (a socket that accepts and closes, one thread per
process for all of them), as each agent's checkpoint server does: the peer probe then runs as on real
nodes (each node connects to up to 8 round peers once a second), and a killed node's port is refused.

stdout: JSON lines. ``{"ev": "ready"}`` once every handler exists; ``{"ev": "joined", ...}`` after the
first round (per node: start, end, rank, world, the round's write time); ``{"ev": "round", ...}`` for
every later round a node joins; ``{"ev": "report", ...}`` on the stdin command ``report`` (lease keep-alive
gaps, leases lost, records published). stdin ``exit`` ends the process (os._exit: leases die with it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import selectors
import socket
import sys
import threading
import time

OUT_LOCK = threading.Lock()


def say(obj: dict) -> None:
    with OUT_LOCK:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()


def fake_record(node_id: str, rng: random.Random) -> dict:
    """The agent's metrics record for a node under a steady load (noise of a few percent)."""
    from elastic_rm.agent.channel import StepSummary
    from elastic_rm.agent.monitor import ResourceSummary, WorkerSummary
    from elastic_rm.agent.record import build_record

    j = lambda x, f=0.02: x * (1 + rng.uniform(-f, f))  # noqa: E731
    resources = ResourceSummary(
        t=time.time(),
        samples=10,
        cpu_util_mean=j(0.6),
        cpu_util_max=j(0.7),
        cpu_util_last=j(0.6),
        mem_used_bytes=int(j(8e9)),
        mem_available_bytes=int(j(24e9)),
        mem_total_bytes=32 * 2**30,
        workers=(WorkerSummary(pid=1000, rss_bytes=int(j(2e9)), cpu_util=j(0.95)),),
        gpus=(),
    )
    steps = StepSummary(
        p50_s=j(0.05),
        p90_s=j(0.06),
        busy_p50_s=j(0.04),
        samples_per_s=j(1000.0),
        steps=int(j(200)),
        age_s=rng.uniform(0, 0.1),
        workers=1,
    )
    return build_record(node_id, resources, steps)


class Node:
    def __init__(self, run: str, handler) -> None:
        self.run, self.handler = run, handler
        self.services = handler.services
        self.busy = True  # a next_rendezvous call is in flight (the first one from the start)
        self.max_gap = 0.0  # longest time without a successful lease refresh, while alive
        self.next_sample = 0.0


def serve_checkpoint_ports(nodes: list[Node]) -> None:
    """A listening socket per node, published as its checkpoint endpoint; one thread accepts (and closes)
    every connection, as a checkpoint server answers the peer probe's connects."""
    sel = selectors.DefaultSelector()
    for node in nodes:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ)
        node.services.set_checkpoint_endpoint(sock.getsockname()[1], "bench")

    def accept_loop() -> None:
        while True:
            for key, _ in sel.select():
                try:
                    conn, _ = key.fileobj.accept()  # type: ignore[union-attr]
                    conn.close()
                except BlockingIOError:
                    pass

    threading.Thread(target=accept_loop, daemon=True, name="ckpt-ports").start()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument(
        "--jobs", required=True, help="RUN:MIN:MAX:COUNT,...: COUNT nodes of run RUN (--nnodes MIN:MAX)"
    )
    p.add_argument("--join-timeout", type=float, default=120)
    p.add_argument("--start-at-file", default=None, help="wait for this file; it holds the start time")
    p.add_argument("--lease-ttl", default=None, help="the handlers' lease_ttl (default: the handler's)")
    p.add_argument("--publish-interval", type=float, default=1.0)
    p.add_argument("--event-sample-interval", type=float, default=10.0)
    p.add_argument(
        "--profile", default=None, help="sample every thread's stack during the join into this file"
    )
    p.add_argument("--ckpt-ports", action="store_true", help="each node serves a checkpoint port (see above)")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from elastic_rm.agent.node_events import emit_sample
    from elastic_rm.etcd.keepalive import REOPENS, STREAMS
    from elastic_rm.rendezvous.registration import register
    from elastic_rm.wire.metrics import encode_record

    register()
    nodes: list[Node] = []
    for spec in args.jobs.split(","):
        run, lo, hi, count = spec.split(":")
        for _ in range(int(count)):
            params = RendezvousParameters(
                "elastic-rm",
                args.endpoint,
                run,
                int(lo),
                int(hi),
                join_timeout=args.join_timeout,
                local_addr="127.0.0.1",
                **({"lease_ttl": args.lease_ttl} if args.lease_ttl else {}),
            )
            nodes.append(Node(run, get_rendezvous_handler(params)))
    k = len(nodes)
    if args.ckpt_ports:
        serve_checkpoint_ports(nodes)
    rows: list[dict] = [{} for _ in range(k)]
    barrier = threading.Barrier(k + 1)

    def timed(row: dict, name: str, fn):
        """Record when ``fn`` first starts (``name``) and first returns (``name``_done): the join's phases."""

        def call(*a, **kw):
            row.setdefault(name, time.time())
            out = fn(*a, **kw)
            row.setdefault(f"{name}_done", time.time())
            return out

        return call

    def join(i: int) -> None:
        node = nodes[i]
        row = rows[i]
        h = node.handler
        h._session.ensure_registered = timed(row, "register", h._session.ensure_registered)
        h._join = timed(row, "seen", h._join)  # the sealed round reached this node's join thread
        barrier.wait()
        row.update(run=node.run, start=time.time())
        try:
            info = node.handler.next_rendezvous()
            row.update(rank=info.rank, world=info.world_size)
            r = node.handler.joined_round
            row.update(round=r.round, round_time=r.time)
        except Exception as exc:  # noqa: BLE001 - reported in the result
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        row["end"] = time.time()
        node.busy = False  # its agent loop takes over (it may have started already)

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    say({"ev": "ready", "nodes": k})
    if args.start_at_file:
        deadline = time.time() + 600
        while not os.path.exists(args.start_at_file) and time.time() < deadline:
            time.sleep(0.01)
        start_at = float(open(args.start_at_file).read() or 0)
        time.sleep(max(0.0, start_at - time.time()))
    sampler = None
    if args.profile:
        from benchmarks.scale.sampler import Sampler

        sampler = Sampler().start()
    barrier.wait()

    stats = {"published": 0, "rejoins": 0, "lease_lost": 0}

    def rejoin(node: Node) -> None:
        try:
            info = node.handler.next_rendezvous()
            r = node.handler.joined_round
            say(
                {
                    "ev": "round",
                    "run": node.run,
                    "round": r.round,
                    "rank": info.rank,
                    "world": info.world_size,
                    "t": time.time(),
                    "round_time": r.time,
                    "node": node.handler.node_id,
                }
            )
        except Exception as exc:  # noqa: BLE001 - reported
            say(
                {
                    "ev": "round",
                    "run": node.run,
                    "error": f"{type(exc).__name__}: {exc}"[:300],
                    "t": time.time(),
                }
            )
        finally:
            node.busy = False

    def agent_loop() -> None:
        """What torch's agent does between rounds, per node: num_nodes_waiting() every 0.1 s."""
        while True:
            now = time.monotonic()
            for node in nodes:
                lease = node.handler._session.lease  # the keep-alive margin: read-only
                if lease is not None and not lease.lost:
                    node.max_gap = max(node.max_gap, now - lease.last_refresh, getattr(lease, "max_gap", 0.0))
                if not node.busy and node.handler.num_nodes_waiting() > 0:
                    node.busy = True
                    stats["rejoins"] += 1
                    threading.Thread(target=rejoin, args=(node,), daemon=True).start()
            time.sleep(0.1)

    def publish_loop() -> None:
        """What each agent's publish thread does once a second (elastic_rm.agent.agent._publish_once)."""
        rng = random.Random(os.getpid())
        while True:
            t0 = time.monotonic()
            for node in nodes:
                joined = node.services.joined_round
                if joined is None:
                    continue
                record = fake_record(node.services.node_id, rng)
                node.services.publish_metrics(encode_record(record))
                stats["published"] += 1
                if args.event_sample_interval > 0 and t0 >= node.next_sample:
                    node.next_sample = t0 + args.event_sample_interval * rng.uniform(0.9, 1.1)
                    emit_sample(node.services.events, node.services.node_id, record, joined)
            time.sleep(max(0.0, args.publish_interval - (time.monotonic() - t0)))

    lag = {"max_s": 0.0}

    def probe_loop() -> None:
        """How late the process's etcd I/O loop runs a 0.1 s timer: how long a keep-alive due then
        waits for the loop (every lease of the process is refreshed from it)."""
        from elastic_rm.etcd.connection import io_loop

        loop = io_loop()

        def tick(due: float) -> None:
            lag["max_s"] = max(lag["max_s"], time.monotonic() - due)
            loop.call_later(0.1, tick, time.monotonic() + 0.1)

        loop.call_soon_threadsafe(tick, time.monotonic())

    # Each node's agent loop runs from its own first round on, as an agent's does: a node that joined
    # early answers a newer round (one that churned while others still join) without waiting for them.
    threading.Thread(target=agent_loop, daemon=True).start()
    for t in threads:
        t.join(args.join_timeout + 15)
    if sampler is not None:
        sampler.stop(args.profile)
    say({"ev": "joined", "rows": rows})
    probe_loop()
    threading.Thread(target=publish_loop, daemon=True).start()
    for line in sys.stdin:
        command = line.strip()
        if command == "report":
            lost = sum(n.handler._session._incarnation for n in nodes)  # leases lost, rejoined under a new id
            gaps = [n.max_gap for n in nodes]
            ttl = nodes[0].services.lease_ttl if nodes else 0.0
            say(
                {
                    "ev": "report",
                    "nodes": k,
                    "published": stats["published"],
                    "rejoins": stats["rejoins"],
                    "lease_lost": lost,
                    "max_gap_s": max(gaps, default=0.0),
                    "lease_ttl_s": ttl,
                    "leading": sum(1 for n in nodes if n.services.leading),
                    "max_loop_lag_s": lag["max_s"],
                    "keepalive_reopens": dict(REOPENS),
                    "keepalive_streams": STREAMS["opened"],
                }
            )
        elif command == "exit":
            break
    os._exit(0)


if __name__ == "__main__":
    main()
