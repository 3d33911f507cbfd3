"""The agent's "restore" events: what its workers restored after a round change (step, the world that
saved and the world that loaded, where each file came from), the steps trained again and the downtime.

Each worker reports after its first step that follows a restore (:mod:`elastic_rm.train.report`,
over the worker channel). The agent knows what the workers cannot: the newest step its old workers
completed and when. Downtime is from that step's end to the end of the first step after the restore (the
node's slowest worker), the same span `erm demo` measures from rank 0's progress lines; steps trained
again are the old workers' newest step minus the restored one (0 after a drain). A worker that stays in
place across the change sends its newest step in its report; the agent's own view (the last batch of step
times, :attr:`AgentChannel.last_step`) can lag it by a batch, so the newer of the two counts.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..obs.events import EventLog
from ..wire.channel import KIND_RESTORED
from ..wire.restore import Restored, decode_restored
from .channel import AgentChannel

log = logging.getLogger(__name__)

MAX_SOURCES_CHARS = 8192
STALE_S = 5.0  # emit what arrived when some local worker did not report within this long


class RestoreTracker:
    """Collects the restore reports of this node's workers and emits one event per restore."""

    def __init__(self, channel: AgentChannel, events: EventLog) -> None:
        self.channel, self.events = channel, events
        self.expected = 1  # reports per restore: the node's local world size (set by the agent)
        self._lock = threading.Lock()
        self._before: tuple[int, float] | None = None  # the old workers' newest step, at the change
        self._pending: list[tuple[float, Restored]] = []
        channel.extra_handlers[KIND_RESTORED] = self._on_restored

    def mark_change(self) -> None:
        """The workers are about to restart or move into a new round: remember their newest step."""
        with self._lock:
            self._before = self.channel.last_step
            self._pending = []

    def poll(self) -> dict[str, Any] | None:
        """Emit a restore whose reports stopped arriving (a worker that died before its first step)."""
        with self._lock:
            if not self._pending or time.time() - self._pending[0][0] < STALE_S:
                return None
            return self._emit_locked()

    def _on_restored(self, _pid: int, body: bytes) -> None:
        report = decode_restored(body)  # ValueError: the channel counts it as malformed
        with self._lock:
            self._pending.append((time.time(), report))
            if len(self._pending) >= self.expected:
                self._emit_locked()

    def _emit_locked(self) -> dict[str, Any]:
        reports, self._pending = self._pending, []
        before, self._before = self._before, None  # one change, one downtime
        first = reports[0][1]
        for _, r in reports:  # a worker that lived through the change knows its newest step exactly
            if r.step_before is not None and (before is None or r.step_before[0] > before[0]):
                before = r.step_before
        sources: dict[str, str] = {}
        for _, r in reports:
            sources.update(r.sources)
        counts: dict[str, int] = {}
        for src in sources.values():
            counts[src] = counts.get(src, 0) + 1
        redone = downtime = None
        if before is not None and before[0] >= first.step:
            redone = before[0] - first.step
            downtime = round(max(t for t, _ in reports) - before[1], 3)
        data = {
            "round": first.round_id,
            "step": first.step,
            "world_before": first.world_before,
            "world_after": first.world_after,
            "last_step_before": before[0] if before is not None else None,
            "redone_steps": redone,
            "downtime_s": downtime,
            "load_s": round(max(r.load_s for _, r in reports), 3),
            "workers": len(reports),
            "sources": sources,
            "files_by_source": counts,
        }
        if len(str(sources)) > MAX_SOURCES_CHARS:  # an event stays small: the counts still say it
            data["sources"] = {}
        again = "-" if redone is None else str(redone)
        down = "-" if downtime is None else f"{downtime:.2f}s"
        files = ", ".join(f"{n} from {src}" for src, n in sorted(counts.items())) or "sources not sent"
        self.events.emit(
            "restore",
            f"round {first.round_id}: restored step {first.step} (saved at world {first.world_before}) into "
            f"world {first.world_after}; {again} step(s) trained again, downtime {down}; files: {files}",
            **data,
        )
        return data
