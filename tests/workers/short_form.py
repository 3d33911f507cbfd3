"""A training loop in the short API's documented form, ``elastic_run(train)``, or (SHORT_FORM=for) the
form that cannot keep its process after a loss, ``for _ in elastic_rounds(): train()``.

Writes $STEPS_DIR/<node>-<local_rank>.jsonl: one line per step with the world and the pid. Ends when
$STEPS_DIR/stop exists (all ranks at the same step: the step's all_reduce carries whether a rank saw it).
With $GLOBAL_BATCH, checks it first as ElasticTraining does.
"""

import json
import os
import time

import torch
import torch.distributed as dist

from elastic_rm.train import elastic_rounds, elastic_run
from elastic_rm.train.report import get_reporter
from elastic_rm.train.world_sizes import check_global_batch


def train() -> bool:
    rep = get_reporter()
    out = os.path.join(
        os.environ["STEPS_DIR"], f"{os.environ['STEPS_NODE']}-{os.environ['LOCAL_RANK']}.jsonl"
    )
    world = dist.get_world_size()
    if os.environ.get("GLOBAL_BATCH"):
        check_global_batch(int(os.environ["GLOBAL_BATCH"]), world)
    with open(out, "a") as fh:
        while True:
            t = torch.tensor([float(os.path.exists(os.path.join(os.environ["STEPS_DIR"], "stop")))])
            dist.all_reduce(t)
            if t[0] > 0:
                return True
            time.sleep(0.02)
            fh.write(json.dumps({"t": time.time(), "step": 1, "world": world, "pid": os.getpid()}) + "\n")
            fh.flush()
            if rep.step(samples=1):
                return False


if __name__ == "__main__":
    if os.environ.get("SHORT_FORM") == "for":
        for _ in elastic_rounds():
            train()
    else:
        elastic_run(train)
