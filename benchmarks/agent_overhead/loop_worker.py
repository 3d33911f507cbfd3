"""A CPU training loop of fixed work per step for part (b): the same script under torchrun and ermrun.

Each step does the same fixed CPU work (WORK_ITERS iterations of integer arithmetic, ~10 ms on an idle core
of the project's machine), all-reduces one float (a synchronous job) and calls the reporting API (a no-op
under torchrun). The work is a count, not a wall-clock deadline: CPU time the agent, its monitor or its
embedded etcd take from the workers makes each step longer, and shows as fewer steps per second. After 1 s
of warm-up, rank 0 counts the steps done in the measured window and writes {"steps": n, "seconds": s,
"cpu_s": its CPU time in the window} to $LOOP_OUT.
"""

import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from elastic_rm.train.report import get_reporter

WORK_ITERS = 200_000


def fixed_work(iters: int) -> int:
    """The step's compute: the same instructions every step, whatever the clock says."""
    x = 0
    for i in range(iters):
        x = (x * 31 + i) & 0xFFFFFFFF
    return x


def main() -> None:
    window = float(sys.argv[1])
    iters = int(sys.argv[2]) if len(sys.argv) > 2 else WORK_ITERS
    dist.init_process_group("gloo")
    rep = get_reporter()
    t = torch.ones(1)
    start = time.perf_counter()
    warm_end, end = start + 1.0, start + 1.0 + window
    steps, counted_from, cpu_from = 0, None, 0.0
    while True:
        # decided collectively, so that every rank runs the same number of all_reduces
        flag = torch.tensor([1.0 if time.perf_counter() >= end else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            break
        fixed_work(iters)
        dist.all_reduce(t)
        rep.step(samples=1)
        now = time.perf_counter()
        if now >= warm_end:
            if counted_from is None:
                counted_from, cpu_from = now, time.process_time()
            steps += 1
    if dist.get_rank() == 0:
        seconds = time.perf_counter() - (counted_from or end)
        cpu_s = time.process_time() - cpu_from
        with open(os.environ["LOOP_OUT"], "w") as fh:
            json.dump({"steps": steps, "seconds": seconds, "cpu_s": cpu_s, "work_iters": iters}, fh)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
