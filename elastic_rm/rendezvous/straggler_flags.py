"""The planner's straggler flags across a change of leader: written into every round, adopted by the next.

Why: the planner's state lives in the leader's memory, and a new leader starts afresh. It re-profiles
safely, but a straggler it no longer knew about was taken back: in the demo the leader was killed right
after a straggler swap, and its successor filled the survivors' round with the replaced node, still
throttled, over the other standby (54.8 s to train again instead of about 5 s). So each round record
carries the flags (``extra.flagged``), and a leader that takes over adopts those of the current round.
"""

from __future__ import annotations

import logging

from ..planner.interface import RoundPolicy
from ..wire.records import RoundRecord

log = logging.getLogger(__name__)


def recorded(policy: RoundPolicy) -> list[str]:
    """The flags to write into a round (none for a policy without stragglers)."""
    return sorted(policy.flagged)


def adopt(policy: RoundPolicy, current: RoundRecord | None, node_id: str) -> None:
    """Seed ``policy`` with the flags of ``current`` (a malformed value is logged and ignored)."""
    if current is None or "flagged" not in current.extra:
        return
    flagged = current.extra["flagged"]
    if not isinstance(flagged, list) or not all(isinstance(n, str) for n in flagged):
        log.warning("round %d: extra.flagged is %r, not a list of node ids; ignored", current.round, flagged)
        return
    if flagged:
        log.info("node %s: straggler flags of round %d taken over: %s", node_id, current.round, flagged)
    policy.adopt_flagged(frozenset(flagged))
