"""The leader's etcd copy of the sample ledger (``<run>/ledger``), as of the newest committed checkpoint.

Why here: the done marks of the sample ledger commit with the flash checkpoint (in its manifest's
position), so the ledger in etcd is taken from committed manifests, never from a worker's live state:
it is never ahead of the model. A checkpoint is news when it is newer in the run's history: a later
step, or any step of a newer timeline (a restore that went back to an older step saves the same step
numbers again, checkpoint/timeline.py). Coarse by construction: one etcd write per checkpoint, by the leader
only (fenced by its election). Workers need no etcd access for it. The leader reads the manifests in
its node's memory; a leader whose node holds none, or that is not a member of the current round (a
standby: what its memory holds is from before it sat out), asks the members' checkpoint servers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checkpoint import timeline
from ..checkpoint.manifest import (
    MANIFEST,
    CorruptCheckpointError,
    committed_steps,
    parse_manifest,
    step_dirname,
)
from ..checkpoint.peers import PeerClient, PeerEndpoint, PeerError
from ..checkpoint.retention import timeline_field
from ..train.ledger import LedgerError, RangeLedger
from ..wire.records import LedgerRecord

log = logging.getLogger(__name__)

PEER_POLL_S = 5.0  # a standby leader asks the members' servers at most this often
PEER_TIMEOUT_S = 3.0


def ledger_record(step: int, node: str, state: dict[str, Any]) -> LedgerRecord:
    """The etcd record of a checkpoint's ledger state; LedgerError when the state is malformed."""
    ledger = RangeLedger.from_checkpoint(state)
    return LedgerRecord(
        step=step,
        node=node,
        time=time.time(),
        epoch=ledger.epoch,
        samples_done=ledger.samples_done(),
        epoch_samples=ledger.num_samples,
        ledger=state,
    )


class LedgerMirror:
    """Call `poll()` periodically (the agent's metrics loop, once a second); it writes only when this node
    leads and a newer committed checkpoint carries a ledger."""

    def __init__(
        self,
        node_id: str,
        node_dir: Callable[[], Path],
        publish: Callable[[LedgerRecord], bool],
        leading: Callable[[], bool],
        peers: Callable[[], list[PeerEndpoint] | None] = lambda: None,
        member: Callable[[], bool] = lambda: True,
    ) -> None:
        self.node_id = node_id
        self._node_dir = node_dir
        self._publish = publish
        self._leading = leading
        self._peers = peers  # the members' checkpoint servers
        self._member = member  # is this node a member of the run's current round?
        # the (timeline, step) of the newest checkpoint written by this node while leading
        self.mirrored: tuple[timeline.Key, int] | None = None
        self._was_leading = False
        self._next_peer_poll = 0.0
        self._bad: set[tuple[str, int]] = set()  # (where, step) already reported as malformed

    def poll(self) -> LedgerRecord | None:
        """Mirror the newest checkpoint's ledger if it is news; the record written, else None."""
        leading = self._leading()
        if leading and not self._was_leading:
            self.mirrored = None  # a new term: state the ledger afresh
        self._was_leading = leading
        if not leading:
            return None
        node_dir = self._node_dir()
        steps = committed_steps(node_dir) if self._member() else []
        found = self._newest_local(node_dir, steps)
        if found is None and not steps and time.monotonic() >= self._next_peer_poll:
            self._next_peer_poll = time.monotonic() + PEER_POLL_S
            found = self._newest_from_peers()
        if found is None:
            return None
        step, state, key = found
        try:
            record = ledger_record(step, self.node_id, state)
        except LedgerError as exc:
            self._report_bad(f"step {step}", step, exc)
            return None
        if not self._publish(record):
            return None
        self.mirrored = (key, step)
        return record

    def _is_news(self, key: timeline.Key, step: int) -> bool:
        return self.mirrored is None or (key, step) > self.mirrored

    def _newest_local(self, node_dir: Path, steps: list[int]) -> tuple[int, dict, timeline.Key] | None:
        """The newest committed step's ledger, if it is news. A node's memory holds one history after
        each restore (the abandoned steps are dropped), so its newest step number is its newest."""
        for step in reversed(steps):
            path = node_dir / step_dirname(step) / MANIFEST
            try:
                if not self._is_news(_cached_timeline(path.parent), step):
                    return None
                raw = path.read_bytes()
            except FileNotFoundError:  # not committed yet (or pruned meanwhile)
                continue
            return self._ledger_of(raw, str(path), step)
        return None

    def _newest_from_peers(self) -> tuple[int, dict, timeline.Key] | None:
        try:
            peers = self._peers() or []
        except Exception as exc:  # noqa: BLE001 - etcd trouble: try again at the next poll
            log.debug("ledger mirror: no peers (%s)", exc)
            return None
        for peer in peers:
            client = PeerClient(peer, PEER_TIMEOUT_S)
            try:
                steps, newest_timeline = client.listing()
                newest = max(steps, default=-1)
                key = timeline.from_json(newest_timeline) or timeline.ORIGIN
                raw = client.manifest(newest) if newest >= 0 and self._is_news(key, newest) else None
            except (PeerError, OSError, ValueError) as exc:
                log.debug("ledger mirror: %s: %s", peer.node, exc)
                continue
            finally:
                client.close()  # the connection the manifest's request kept
            if raw is not None:
                return self._ledger_of(raw, f"{peer.node}: manifest of step {newest}", newest)
        return None

    def _ledger_of(self, raw: bytes, where: str, step: int) -> tuple[int, dict, timeline.Key] | None:
        try:
            doc = parse_manifest(raw, where)
        except CorruptCheckpointError as exc:
            self._report_bad(where, step, exc)
            return None
        state = doc["position"].get("ledger")
        if not isinstance(state, dict):  # a job without a sample ledger: nothing to mirror
            return None
        return doc["step"], state, timeline.key_of(doc)

    def _report_bad(self, where: str, step: int, exc: Exception) -> None:
        if (where, step) not in self._bad:
            self._bad.add((where, step))
            log.warning("ledger mirror: not mirroring the ledger of step %d: %s", step, exc)


def _cached_timeline(step_dir: Path) -> timeline.Key:
    """A committed step's timeline from the manifest cache (the mirror polls every second); one that does
    not read here is parsed, and reported, by _ledger_of."""
    try:
        raw = timeline_field(step_dir)
    except (ValueError, RecursionError):
        return timeline.ORIGIN
    return timeline.from_json(raw) or timeline.ORIGIN  # as a peer's listing is read
