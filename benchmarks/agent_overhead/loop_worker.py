"""A tight CPU training loop of ~10 ms steps for part (b): the same script under torchrun and ermrun.

Each step spins 10 ms, all-reduces one float (a synchronous job) and calls the reporting API (a no-op
under torchrun). After 1 s of warm-up, rank 0 counts the steps done in the measured window and writes
{"steps": n, "seconds": s} to $LOOP_OUT.
"""

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic_rm.train.report import get_reporter


def main() -> None:
    window = float(sys.argv[1])
    dist.init_process_group("gloo")
    rep = get_reporter()
    t = torch.ones(1)
    start = time.perf_counter()
    warm_end, end = start + 1.0, start + 1.0 + window
    steps, counted_from = 0, None
    while True:
        # decided collectively, so that every rank runs the same number of all_reduces
        flag = torch.tensor([1.0 if time.perf_counter() >= end else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        spin_end = time.perf_counter() + 0.010
        while time.perf_counter() < spin_end:
            pass
        dist.all_reduce(t)
        rep.step(samples=1)
        now = time.perf_counter()
        if now >= warm_end:
            if counted_from is None:
                counted_from = now
            steps += 1
    if dist.get_rank() == 0:
        with open(os.environ["LOOP_OUT"], "w") as fh:
            json.dump({"steps": steps, "seconds": time.perf_counter() - (counted_from or end)}, fh)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
