"""What the agent's helpers need from the agent: a declared interface instead of its private state.

The round in place (:mod:`elastic_rm.agent.inplace`), the prepared start (:mod:`elastic_rm.agent.prepared`)
and `erm stop`'s drain (:mod:`elastic_rm.agent.stop`) act on the agent's workers and say what they did in
its event log. They are called by :class:`elastic_rm.agent.agent.ElasticRMAgent`, which imports them, so
they name this Protocol rather than the agent's class; the agent implements it with public members, and
those that wrap torch's ``LocalElasticAgent`` internals are the only place the helpers meet torch's state.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup
from torch.distributed.elastic.multiprocessing.api import PContext

from ..obs.events import EventLog
from ..obs.metrics import AgentMetrics
from ..rendezvous.services import NodeServices
from ..wire.records import RoundRecord
from .channel import AgentChannel
from .spares import SpareContext

# torch's (args, environments, log line prefixes) of a worker group's start, per local rank
WorkerStart = tuple[dict[int, tuple], dict[int, dict[str, str]], Any]


class AgentHost(Protocol):
    """The agent as its helpers see it (implemented by ``ElasticRMAgent``)."""

    node_id: str
    events: EventLog
    channel: AgentChannel
    metrics: AgentMetrics
    stop_reason: str | None  # why the agent stopped its workers for good (`erm stop`), else None

    @property
    def services(self) -> NodeServices | None:
        """The rendezvous' node services (None under torch's own backends)."""

    @property
    def joined_round(self) -> RoundRecord | None:
        """The last round this node joined."""

    @property
    def remaining_restarts(self) -> int:
        """torch's restarts left (``--max-restarts`` less those used)."""

    @property
    def process_context(self) -> PContext | None:
        """torch's process context of the running workers."""

    @process_context.setter
    def process_context(self, context: PContext | None) -> None: ...

    def get_worker_group(self) -> WorkerGroup:
        """torch's worker group of this node."""

    def membership_grace(self) -> float:
        """How long failed workers wait for a new round before their failure counts."""

    def emit_failure(self, result: RunResult, outcome: str) -> None:
        """Say a failed worker group in the event log, with what follows (``outcome``)."""

    def rendezvous(self, group: WorkerGroup) -> None:
        """torch's rendezvous and rank exchange for ``group`` (a round its workers join in place)."""

    def set_worker_environment(self, round_id: int) -> None:
        """Set what every start of the workers inherits for round ``round_id``."""

    def worker_start(self, group: WorkerGroup) -> WorkerStart:
        """What torch's ``_start_workers`` would give ``group``'s workers, without starting them."""

    def start_workers_with(self, group: WorkerGroup, given: WorkerStart) -> SpareContext:
        """Start ``group``'s workers with ``given``, from the node's warm spares where there are some."""

    def guard_processes(self, pids: list[int]) -> None:
        """End these processes with the agent, even when it is killed."""

    def kill_workers(self) -> None:
        """torch's stop of the workers with SIGKILL (no grace)."""
