"""``ElasticRMAgent``: torch's ``LocalElasticAgent`` plus what elastic-rm needs on each node.

Extension points used (anchors.md, B.3): ``_start_workers`` (the environment every worker inherits)
and ``_stop_workers`` (drain at a step boundary before torch terminates the workers). Both are
private torch methods; ``tests/agent/test_torch_contract.py`` pins their signatures so that a torch
upgrade that changes them fails loudly instead of silently skipping our hooks.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AgentOptions:
    """elastic-rm's per-node options (``ermrun --help``, group "elastic-rm")."""

    node_id: str | None = None
    # Workers that fail while a member of their world vanishes are victims, not culprits: wait this long
    # for the new round before counting the failure against --max-restarts (None: the rendezvous lease
    # TTL + 1 s with the elastic-rm backend; 0 with torch's backends, which do not report lost nodes).
    membership_grace_s: float | None = None


class ElasticRMAgent(LocalElasticAgent):
    def __init__(self, *args: Any, options: AgentOptions | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.options = options or AgentOptions()

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """torch's monitor, except that a failure caused by a lost peer becomes a membership restart.

        When a member node dies, the survivors' collectives fail at once, long before its lease expires.
        torch would count that against --max-restarts (and, at 0, end the job). We wait up to
        ``membership_grace_s`` for the rendezvous to show a newer round; if it does, we report HEALTHY
        so that torch's loop sees ``num_nodes_waiting() > 0`` and re-rendezvous without using a restart.
        """
        result = super()._monitor_workers(worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        handler = worker_group.spec.rdzv_handler
        deadline = time.monotonic() + self._membership_grace(handler)
        while time.monotonic() < deadline:
            if handler.is_closed():
                break
            if handler.num_nodes_waiting() > 0:
                log.info("workers failed while the membership changed: re-rendezvous without using a restart")
                return RunResult(state=WorkerState.HEALTHY)
            time.sleep(0.05)
        return result

    def _membership_grace(self, handler: Any) -> float:
        if self.options.membership_grace_s is not None:
            return self.options.membership_grace_s
        settings = getattr(handler, "settings", None)
        return float(settings.lease_ttl) + 1.0 if hasattr(settings, "lease_ttl") else 0.0

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        return super()._start_workers(worker_group)

    def _stop_workers(self, worker_group: WorkerGroup, *args: Any, **kwargs: Any) -> None:
        super()._stop_workers(worker_group, *args, **kwargs)

    def close(self) -> None:
        """Stop what the agent started besides the workers (idempotent)."""
