"""One rendezvous node for the failure benchmark: joins, reports, then waits for the next round.

stdin commands: ``go`` (call next_rendezvous now: the workers crashed, as after a peer's SIGKILL) or
``watch`` (poll num_nodes_waiting() every 0.1 s like torch's agent, then re-rendezvous: the workers
hang, as after a peer's SIGSTOP). Prints one JSON line per completed round.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--endpoint", required=True)
    p.add_argument("--run-id", required=True)
    p.add_argument("--nnodes", default="2:3")
    p.add_argument("--limit", type=float, default=90.0)
    args = p.parse_args()
    logging.basicConfig(level=logging.ERROR)
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

    from elastic_rm.rendezvous.registration import register

    register()
    lo, hi = (int(x) for x in args.nnodes.split(":"))
    conf: dict = {"join_timeout": 120}
    if args.backend == "c10d":
        conf["is_host"] = False
    if args.backend == "elastic-rm":
        conf["local_addr"] = "127.0.0.1"
    handler = get_rendezvous_handler(
        RendezvousParameters(args.backend, args.endpoint, args.run_id, lo, hi, **conf)
    )
    info = handler.next_rendezvous()
    print(json.dumps({"round": 1, "rank": info.rank, "world": info.world_size, "t": time.time()}), flush=True)
    command = sys.stdin.readline().strip()
    deadline = time.time() + args.limit
    if command == "watch":
        while handler.num_nodes_waiting() == 0 and time.time() < deadline:
            time.sleep(0.1)
        if time.time() >= deadline:
            print(
                json.dumps({"round": None, "t": time.time(), "error": "num_nodes_waiting stayed 0"}),
                flush=True,
            )
            os._exit(0)
    info = handler.next_rendezvous()
    print(json.dumps({"round": 2, "rank": info.rank, "world": info.world_size, "t": time.time()}), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
