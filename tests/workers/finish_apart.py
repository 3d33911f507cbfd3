"""Nodes that finish apart: one all_reduce, then group rank 0 returns at once and group rank 1 fails a
second later (exit status 3), after its peer's agent has reached torch's exit barrier."""

import os
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
dist.destroy_process_group()
if os.environ["GROUP_RANK"] == "1":
    time.sleep(1.0)
    sys.exit(3)
