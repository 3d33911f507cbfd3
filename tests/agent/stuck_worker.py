"""A worker for test_inplace_stacks: its round's body blocks in a call that never returns (as a collective
waiting on a peer that will never answer) inside ``with rnd:``, so it never holds a failed round. With the
argument ``own-handler`` the script handles the agent's stacks signal itself and says so on stdout when
the signal comes."""

from __future__ import annotations

import os
import signal
import sys

from elastic_rm.train.report import StepReporter
from elastic_rm.train.rounds import rounds
from elastic_rm.wire.channel import STACKS_SIGNAL


def wait_for_the_dead_peer() -> None:
    read_end, _write_end = os.pipe()
    print("blocked", flush=True)
    os.read(read_end, 1)  # nothing is ever written


if sys.argv[1:] == ["own-handler"]:
    signal.signal(STACKS_SIGNAL, lambda *_: print("own handler ran", flush=True))

for rnd in rounds(StepReporter()):
    with rnd:
        wait_for_the_dead_peer()
