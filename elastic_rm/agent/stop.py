"""`erm stop RUN`: the agent's half. The run's ``closed`` record says ``by: "erm stop"``; each agent then
drains the workers that use the API at a step boundary (their final flash checkpoint) and tells those that
keep their processes across rounds to leave; workers that do not use the API (a plain torchrun script),
or that did not reach a step boundary within ``--drain-grace``, get SIGTERM, and SIGKILL after another
``--drain-grace``. The worker group is then reported as finished: torch's exit barrier, then the launch
path frees node memory and the agent exits 0.

Why the ``closed`` key: every agent already watches it (no extra etcd traffic), and a closed run is what a
stopped run is. A run closed by a node (the job ended, or failed) does not trigger this: its workers are
done or failing, and draining them would only delay the agent.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import TYPE_CHECKING

from ..rendezvous.services import NodeServices
from ..wire.channel import ROUND_LEAVE

if TYPE_CHECKING:  # `erm stop` imports this module for STOP_BY: without torch
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup

    from .host import AgentHost

log = logging.getLogger(__name__)

STOP_BY = "erm stop"  # the closed record's "by" (node ids cannot contain a space)
EXIT_LIMIT_S = 30.0  # how long drained workers get to exit on their own before they are stopped
POLL_S = 0.05
TORCH_PROCESS_LOG = "torch.distributed.elastic.multiprocessing.api"  # torch's worker processes' logger


def requested(services: NodeServices | None) -> bool:
    """Whether `erm stop` closed this node's run (node services only: torch's backends have none)."""
    return services is not None and services.closed_by == STOP_BY


def terminate(pids: list[int], sig: int) -> None:
    """``sig`` to each worker's process group (torch starts every worker in a session of its own, as
    torch's own stop signals it), or to the process when it leads none."""
    for pid in pids:
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


class _SignalledExits(logging.Filter):
    """torch logs a worker that ends by the stop's own SIGTERM as an error ("failed (exitcode: -15)"):
    at `erm stop` that is the expected end, said in the drain event instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed (exitcode: ")


def wait_exit(agent: AgentHost, limit_s: float) -> RunResult | None:
    """torch's process context's result once every worker exited; None when some still run at the limit."""
    deadline = time.monotonic() + limit_s
    quiet = _SignalledExits()
    torch_log = logging.getLogger(TORCH_PROCESS_LOG)
    torch_log.addFilter(quiet)
    try:
        while (context := agent.process_context) is not None:
            result = context.wait(0)
            if result is not None or time.monotonic() >= deadline:
                return result
            time.sleep(POLL_S)
        return None
    finally:
        torch_log.removeFilter(quiet)


def stop_workers(agent: AgentHost, group: WorkerGroup, grace: float) -> RunResult:
    """Drain (``grace``: ``--drain-grace``), let the drained workers exit, signal the others; a finished
    worker group (torch's RunResult: torch then ends the run)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState  # erm stop: no torch

    t0 = time.monotonic()
    agent.metrics.set_state("draining")
    agent.channel.request_drain()
    pids = [w.id for w in group.workers if w.id is not None]
    plain = list(agent.channel.wait_for_acks(timeout_s=0, pids=pids).unregistered)
    terminate(plain, signal.SIGTERM)  # no drain to wait for: a plain script ends as under torchrun's stop
    drained = agent.channel.wait_for_acks(timeout_s=grace, pids=[p for p in pids if p not in plain])
    joined = agent.joined_round
    for pid in drained.acked:  # a worker in rounds() waits for word after its drain: it leaves (exit 0)
        agent.channel.send_round(pid, ROUND_LEAVE, joined.round if joined is not None else 0, {})
    late = [p for p in pids if p not in drained.acked and p not in plain]  # no step boundary in time
    terminate(late, signal.SIGTERM)
    others = plain + late
    result = wait_exit(agent, grace if others else EXIT_LIMIT_S)
    killed = result is None
    if killed:
        agent.kill_workers()
    steps = sorted(set(drained.acked.values()))
    if killed:
        ended = "killed (SIGKILL) after the grace"
    elif others:
        ended = f"{len(others)} stopped by SIGTERM"
    else:
        ended = "exited"
    message = (
        f"erm stop: drained {len(drained.acked)} worker(s)"
        + (f" at step {'/'.join(map(str, steps))}" if steps else "")
        + f", {len(plain)} without the API; workers {ended} in {time.monotonic() - t0:.2f}s"
    )
    if late:  # which workers did not drain, and why
        why = {
            "the final hook raised": [p for p in late if p in drained.failed],
            "exited without an ack": [p for p in late if p in drained.exited],
            f"no step boundary within {grace:g}s": [p for p in late if p in drained.missing],
        }
        message += "; did not drain: " + "; ".join(f"pid(s) {ps} ({w})" for w, ps in why.items() if ps)
    log.info("%s", message)
    agent.events.emit(
        "drain",
        message,
        steps=steps,
        acked=len(drained.acked),
        stop=True,
        missing=len(drained.missing),
        unregistered=len(plain),
        signalled=len(others),
        killed=killed,
    )
    agent.stop_reason = STOP_BY
    # torch records every worker's state from the result: each global rank must be in it
    values = {} if result is None else dict(result.return_values)
    returned = {w.global_rank: values.get(w.local_rank) for w in group.workers}
    return RunResult(state=WorkerState.SUCCEEDED, return_values=returned)
