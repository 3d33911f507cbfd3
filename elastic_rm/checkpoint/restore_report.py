"""Who hears what a restore did: the worker's step reporter (:mod:`elastic_rm.train.report`) listens, to
count the job's steps from the restored one and to tell the agent the world that saved, the world that
loaded and where each file came from (the agent's "restore" event, :mod:`elastic_rm.agent.restores`).

The reporter sits above the checkpoint (training code uses both), so it registers itself here when it is
imported instead of the checkpoint importing it. A restore made before any listener is kept for the first
one, so a script that imports the reporter after restoring still reports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .restore import RestoreResult

RestoreListener = Callable[["RestoreResult", int], None]

_LISTENERS: list[RestoreListener] = []
_UNHEARD: list[tuple[int, RestoreResult, int]] = []  # (pid, result, world after) before any listener


def listen_for_restores(listener: RestoreListener) -> None:
    """Call ``listener(result, world_after)`` after every restore of this process, first for the ones
    made before it listened."""
    _LISTENERS.append(listener)
    unheard = [(result, world) for pid, result, world in _UNHEARD if pid == os.getpid()]
    _UNHEARD.clear()
    for result, world in unheard:
        listener(result, world)


def report_restore(result: RestoreResult, world_after: int) -> None:
    """Hand a restore into a world of ``world_after`` ranks to the listeners (or keep it for the first)."""
    if not _LISTENERS:
        _UNHEARD.append((os.getpid(), result, world_after))
    for listener in _LISTENERS:
        listener(result, world_after)
