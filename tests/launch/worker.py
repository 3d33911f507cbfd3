"""A gloo loop for the launch tests, in the record format of tests/workers/steps.py (one JSON line per
step, named after the node id), that stops every rank at the same step: at $STEPS_MAX steps, or once
$STEPS_DIR/stop exists on any rank (agreed through the step's all_reduce, so no rank is left waiting).
With $IGNORE_SIGTERM=1 it ignores SIGTERM: a worker whose node only a kill stops."""

import gc
import json
import os
import signal
import time

import torch
import torch.distributed as dist


def main() -> None:
    out_dir = os.environ["STEPS_DIR"]
    node = os.environ.get("ERM_NODE_ID", "node")
    max_steps = int(os.environ.get("STEPS_MAX", "0"))
    stop_file = os.path.join(out_dir, "stop")
    if os.environ.get("IGNORE_SIGTERM") == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(out_dir, f"{node}-{os.environ['LOCAL_RANK']}.jsonl"), "a") as fh:
        env = {k: os.environ.get(k) for k in ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "ERM_LAUNCH_HOST")}
        fh.write(
            json.dumps(
                {
                    "start": True,
                    "t": time.time(),
                    "rank": rank,
                    "world": world,
                    "env": env,
                    "pid": os.getpid(),
                }
            )
            + "\n"
        )
        fh.flush()
        step = 0
        while True:
            stop = float((max_steps and step >= max_steps) or os.path.exists(stop_file))
            t = torch.tensor([1.0, stop])
            dist.all_reduce(t)
            assert int(t[0].item()) == world
            if t[1].item() > 0:
                break
            step += 1
            fh.write(json.dumps({"t": time.time(), "rank": rank, "world": world, "step": step}) + "\n")
            fh.flush()
            time.sleep(0.02)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
