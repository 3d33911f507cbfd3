"""`erm stop RUN`: the agent's half. The run's ``closed`` record says ``by: "erm stop"``; each agent then
drains its workers at a step boundary (their final flash checkpoint), tells workers that keep their
processes across rounds to leave, waits for them to exit, stops what is left as torch would, and reports
the worker group as finished: torch's exit barrier, then the launch path frees node memory and the agent
exits 0.

Why the ``closed`` key: every agent already watches it (no extra etcd traffic), and a closed run is what a
stopped run is. A run closed by a node (the job ended, or failed) does not trigger this: its workers are
done or failing, and draining them would only delay the agent.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from ..rendezvous.services import NodeServices
from ..wire.channel import ROUND_LEAVE

log = logging.getLogger(__name__)

STOP_BY = "erm stop"  # the closed record's "by" (node ids cannot contain a space)
EXIT_LIMIT_S = 30.0  # how long drained workers get to exit before they are stopped


def requested(services: NodeServices | None) -> bool:
    """Whether `erm stop` closed this node's run (node services only: torch's backends have none)."""
    return services is not None and services.closed_by == STOP_BY


def stop_workers(agent: Any, group: Any) -> Any:
    """Drain, let the workers exit, stop the rest; a finished worker group (torch's RunResult: torch then
    ends the run)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState  # erm stop: no torch

    t0 = time.monotonic()
    agent.metrics.set_state("draining")
    agent.channel.request_drain()
    pids = [w.id for w in group.workers if w.id is not None]
    drained = agent.channel.wait_for_acks(timeout_s=agent.options.drain_grace_s, pids=pids)
    joined = agent.joined_round
    for pid in drained.acked:  # a worker in rounds() waits for word after its drain: it leaves (exit 0)
        agent.in_place._tell(pid, ROUND_LEAVE, joined.round if joined is not None else 0, {})
    result = None
    deadline = time.monotonic() + EXIT_LIMIT_S
    while agent._pcontext is not None and time.monotonic() < deadline:
        result = agent._pcontext.wait(0)  # torch's process context: a result once all exited
        if result is not None:
            break
        time.sleep(0.05)
    if result is None:
        agent._stop_workers(group)  # torch's stop: SIGTERM, then SIGKILL after --shutdown-timeout
    steps = sorted(set(drained.acked.values()))
    codes = {} if result is None else {str(r): f.exitcode for r, f in result.failures.items()}
    ended = "exited" if result is not None and not codes else f"stopped (exit codes {codes or 'unknown'})"
    message = (
        f"erm stop: drained {len(drained.acked)} worker(s)"
        + (f" at step {'/'.join(map(str, steps))}" if steps else "")
        + f", {len(drained.unregistered)} without the API; workers {ended} in {time.monotonic() - t0:.2f}s"
    )
    log.info("%s", message)
    agent.events.emit("drain", message, steps=steps, acked=len(drained.acked), stop=True,
                      missing=len(drained.missing), unregistered=len(drained.unregistered))  # fmt: skip
    agent.stop_reason = STOP_BY
    by_local = {w.local_rank: w.global_rank for w in group.workers}  # torch reports by global rank
    values = {} if result is None else {by_local[r]: v for r, v in result.return_values.items()}
    return RunResult(state=WorkerState.SUCCEEDED, return_values=values)
