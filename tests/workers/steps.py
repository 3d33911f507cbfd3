"""A tiny gloo training loop for launcher tests: one all_reduce per step, one JSON line per step.

Writes to $STEPS_DIR/<node>.jsonl (node = $STEPS_NODE); the first line of each start carries the
names and values of the torchelastic environment variables. Stops after $STEPS_MAX steps (default:
forever) or when $STEPS_DIR/stop exists (all ranks after the same step: the step's all_reduce carries
whether a rank saw the file).
"""

import gc
import json
import os
import time

import torch
import torch.distributed as dist

ENV = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMP_NUM_THREADS",
)


def main() -> None:
    out_dir = os.environ["STEPS_DIR"]
    node = os.environ.get("STEPS_NODE", "node")
    max_steps = int(os.environ.get("STEPS_MAX", "0"))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = os.path.join(out_dir, f"{node}-{os.environ['LOCAL_RANK']}.jsonl")
    with open(path, "a") as fh:
        env = {k: os.environ.get(k) for k in ENV}
        names = sorted(k for k in os.environ if k.startswith(("TORCHELASTIC_", "PET_")) or k in ENV)
        fh.write(
            json.dumps(
                {
                    "start": True,
                    "t": time.time(),
                    "pid": os.getpid(),
                    "rank": rank,
                    "world": world,
                    "env": env,
                    "names": names,
                }
            )
            + "\n"
        )
        fh.flush()
        step, stop = 0, False
        while not (max_steps and step >= max_steps) and not stop:
            # [1, stop file seen]: the ranks agree on the step they stop after. Each looking for the file on
            # its own let one rank (whose all_reduce returned a retransmit later) start a step the others
            # had left: its collective failed and the agents' exits waited on it.
            t = torch.tensor([1.0, float(os.path.exists(os.path.join(out_dir, "stop")))])
            dist.all_reduce(t)
            assert int(t[0].item()) == world
            stop = t[1].item() > 0
            step += 1
            fh.write(json.dumps({"t": time.time(), "rank": rank, "world": world, "step": step}) + "\n")
            fh.flush()
            time.sleep(0.02)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
