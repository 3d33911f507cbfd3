"""A worker that uses elastic_rm.train.report: steps of ~20 ms, a final hook that records its step.

Writes $STEPS_DIR/<node>-<local_rank>.jsonl: one line per step, {"stopped_at": n} from the drain hook.
Ends when $STEPS_DIR/stop exists (all ranks at the same step).
"""

import gc
import json
import os
import time

import torch
import torch.distributed as dist

from elastic_rm.train.report import get_reporter


def main() -> None:
    out = os.path.join(
        os.environ["STEPS_DIR"], f"{os.environ.get('STEPS_NODE', 'n')}-{os.environ['LOCAL_RANK']}.jsonl"
    )
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    fh = open(out, "a")
    rep = get_reporter(sync_every=1)

    @rep.on_stop
    def final(step: int) -> None:
        fh.write(json.dumps({"t": time.time(), "stopped_at": step, "world": world}) + "\n")
        fh.flush()

    step = 0
    while True:
        # The stop file is agreed on in the step's all_reduce: every rank stops at the same step (a rank
        # that stopped alone would leave its peers failing in the next collective).
        t = torch.tensor([1.0, float(os.path.exists(os.path.join(os.environ["STEPS_DIR"], "stop")))])
        dist.all_reduce(t)
        if t[1] > 0:
            break
        end = time.perf_counter() + 0.02
        while time.perf_counter() < end:  # busy: the monitor must see about one core per worker
            pass
        step += 1
        fh.write(json.dumps({"t": time.time(), "step": step, "world": world, "rank": dist.get_rank()}) + "\n")
        fh.flush()
        if rep.step(samples=8):
            break
    fh.close()
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
