"""A worker for test_inplace_stacks: its round's body blocks in a call that never returns (as a collective
waiting on a peer that will never answer) inside ``with rnd:``, so it never holds a failed round."""

from __future__ import annotations

import os

from elastic_rm.train.report import StepReporter
from elastic_rm.train.rounds import rounds


def wait_for_the_dead_peer() -> None:
    read_end, _write_end = os.pipe()
    print("blocked", flush=True)
    os.read(read_end, 1)  # nothing is ever written


for rnd in rounds(StepReporter()):
    with rnd:
        wait_for_the_dead_peer()
