"""A decided round's outcome: what it did against what the planner predicted (``rounds/<n>/outcome``).

Why a module of its own: the leader that writes a round is not always the one that measures it. A
leader that leaves itself out of the round it writes (a swapped straggler, a node scaled away) hands the
leadership to a member (leader.py), and a leader can fail. So the throughput before the round travels in
the round record (``extra.throughput_before``), and whichever leader holds the round when its window has
run measures it, the same way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ..planner.job import finite
from ..wire.records import RoundRecord

# A decided round's outcome is measured once every member reported steps for this long: one full window
# of the agents' step summaries (elastic_rm.agent.agent.STEP_WINDOW_S), so it holds only the new round.
OUTCOME_WINDOW_S = 10.0
BEFORE = "throughput_before"  # the round record's extra field: the job's samples/s when it was decided


@dataclass
class PendingOutcome:
    """A written round whose outcome is not measured yet."""

    round: int
    before: float | None  # samples/s of the job when the round was decided (None: not every member had steps)
    since: float | None = None  # monotonic time from which every member of the round reported steps

    @classmethod
    def of(cls, r: RoundRecord | None) -> PendingOutcome | None:
        """The pending outcome of round ``r`` for a leader that did not write it (None: ``r`` is no
        decided round, e.g. the first one)."""
        if r is None or not r.members or BEFORE not in r.extra:
            return None
        return cls(r.round, _throughput(r.extra[BEFORE]))

    def measured(
        self, r: RoundRecord, throughput: float | None, coef: list[float], now: float | None = None
    ) -> dict | None:
        """The outcome record once round ``r`` ran a full window with every member's steps; None until
        then. ``throughput``: the job's samples/s now (None: some member has no steps yet)."""
        now = time.monotonic() if now is None else now
        if throughput is None:
            self.since = None
            return None
        if self.since is None:
            self.since = now
        if now - self.since < OUTCOME_WINDOW_S:
            return None
        measured = throughput / self.before - 1 if self.before else None
        predicted = r.predicted_gain
        error = predicted - measured if predicted is not None and measured is not None else None
        return {
            "v": 1,
            "round": r.round,
            "reason": r.reason,
            "world": len(r.members),
            "throughput_before": self.before,
            "throughput_after": throughput,
            "measured_gain": measured,
            "predicted_gain": predicted,
            "prediction_error": error,
            "time": time.time(),
            "coef": coef,
        }


def _throughput(value: object) -> float | None:
    """A round's ``throughput_before`` as written by its leader, else None (unknown). Any other value is
    unknown too: float() of a 400-digit integer raised OverflowError on every step of a new leader, and
    a NaN became an outcome record with a NaN gain."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not finite(value):
        return None
    return float(value)
