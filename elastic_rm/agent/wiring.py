"""What the agent builds from its rendezvous handler: the run's event log and the leader's ledger mirror.

Why a module of its own: both depend only on the handler and the node services, not on the agent's
state, and the agent stays the place for torch's hooks."""

from __future__ import annotations

from typing import Any

from ..obs.events import EventLog
from ..rendezvous.services import NodeServices
from ..train.paths import run_memory_dir
from . import ckpt_hooks
from .ledger_mirror import LedgerMirror


def open_event_log(handler: Any, services: NodeServices | None, node_id: str, path: str | None) -> EventLog:
    """The run's event log in etcd (node services), else a local one (torch's backends); plus the
    ``--event-log`` file at ``path``."""
    events = services.events if services is not None else EventLog(handler.get_run_id(), node_id)
    if path:
        try:
            events.attach_file(path)
        except OSError as exc:
            raise ValueError(f"--event-log {path}: cannot append to it ({exc})") from exc
    return events


def ledger_mirror_for(handler: Any, services: NodeServices | None, node_id: str) -> LedgerMirror | None:
    """The leader's etcd copy of the checkpointed sample ledger (node services only)."""
    if services is None:
        return None
    root = run_memory_dir(handler.get_run_id())
    return LedgerMirror(
        node_id,
        node_dir=lambda: root / services.node_id,  # the id changes when the node rejoins
        publish=services.publish_ledger,
        leading=lambda: services.leading,
        peers=lambda: ckpt_hooks.peer_endpoints(services),
    )
