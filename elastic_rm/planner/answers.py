"""How every planner rule answers: at most one Decision per round until it is written, standby lists capped.

Why a module of its own: the round rules (policy.py) and the memory rules (memory_rules.py) both end in
one of these two functions, so both keep the same no-duplicate-rounds guarantee. Pure, like the planner.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from .interface import Decision, Wait
from .state import PlannerState

Answer = Decision | Wait


def standby(candidates: Iterable[str], flagged: frozenset[str], limit: int) -> tuple[str, ...]:
    """The standby list of a round: waiting nodes not flagged as stragglers, at most `limit`."""
    return tuple(n for n in candidates if n not in flagged)[:limit]


def decide(
    state: PlannerState,
    cur_number: int,
    members: Iterable[str],
    standby_nodes: Iterable[str],
    reason: str,
    gain: float | None = None,
    confidence: float | None = None,
) -> tuple[Answer, PlannerState]:
    """A Decision for the round after `cur_number`, remembered in the state; the same one again while the
    first is not written yet answers Wait, so the leader never writes two rounds for one change."""
    key = (tuple(members), tuple(standby_nodes))
    if state.decided_on_round == cur_number and state.pending == key:
        return Wait(f"round after {cur_number} decided, not yet written"), state
    d = Decision(key[0], key[1], reason, gain, confidence)
    return d, replace(state, decided_on_round=cur_number, pending=key, decisions=state.decisions + 1)
