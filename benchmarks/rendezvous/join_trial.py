"""One join trial in this process: K rendezvous handlers, one per thread, for a world of N nodes.

Prints one JSON line: per-handler start/end wall-clock times, ranks, errors. With several trial
processes for one world (``--start-at``), all of them begin joining at the same wall-clock instant.
The process ends with os._exit so that keep-alive threads and leases die with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--world", type=int, required=True, help="N: nodes in the world")
    p.add_argument("--handlers", type=int, required=True, help="K: handlers in this process")
    p.add_argument("--run-id", required=True)
    p.add_argument("--join-timeout", type=float, default=60)
    p.add_argument("--ready-file", default=None)
    p.add_argument("--start-at-file", default=None, help="wait for this file; it holds the start time")
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)

    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from elastic_rm.rendezvous.registration import register

    register()
    conf: dict = {"join_timeout": args.join_timeout}
    if args.backend == "c10d":
        conf["is_host"] = False
    if args.backend == "elastic-rm":
        conf = {"join_timeout": args.join_timeout, "local_addr": "127.0.0.1"}
    k = args.handlers
    handlers = []
    for _ in range(k):
        params = RendezvousParameters(
            args.backend, args.endpoint, args.run_id, args.world, args.world, **conf
        )
        handlers.append(get_rendezvous_handler(params))
    starts, ends, ranks, errors = [0.0] * k, [0.0] * k, [-1] * k, [None] * k
    barrier = threading.Barrier(k + 1)

    def join(i: int) -> None:
        barrier.wait()
        starts[i] = time.time()
        try:
            info = handlers[i].next_rendezvous()
            ranks[i] = info.rank
            assert info.world_size == args.world
        except Exception as exc:  # noqa: BLE001 - reported in the result
            errors[i] = f"{type(exc).__name__}: {exc}"[:300]
        ends[i] = time.time()

    threads = [threading.Thread(target=join, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()
    if args.ready_file:
        open(args.ready_file, "w").close()
    if args.start_at_file:
        deadline = time.time() + 120
        while not os.path.exists(args.start_at_file) and time.time() < deadline:
            time.sleep(0.01)
        start_at = float(open(args.start_at_file).read() or 0)
        time.sleep(max(0.0, start_at - time.time()))
    barrier.wait()
    for t in threads:
        t.join(args.join_timeout + 15)
    print(json.dumps({"starts": starts, "ends": ends, "ranks": ranks, "errors": errors}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
