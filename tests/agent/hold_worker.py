"""A worker for test_inplace_hold: every round's body fails inside ``with rnd:``; prints what it saw."""

from __future__ import annotations

import json
import sys

import torch.distributed as dist

from elastic_rm.train.report import StepReporter
from elastic_rm.train.rounds import RoundFailedError, rounds

seen = []
try:
    for rnd in rounds(StepReporter()):
        seen.append([rnd.index, rnd.round_id, rnd.in_place, dist.get_world_size()])
        with rnd:
            raise RuntimeError("Connection reset by peer" if rnd.index == 0 else "second failure")
except RoundFailedError as exc:
    print(json.dumps({"seen": seen, "error": str(exc), "initialized": dist.is_initialized()}), flush=True)
    sys.exit(3)
