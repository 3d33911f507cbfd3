"""Launch one node's agent the way torch's ``launch_agent`` does, with our agent class.

torchrun has no entry point for the agent (its ``launch_agent`` builds a ``LocalElasticAgent``), so
instead of patching torch's module globals we rebuild its short launch path from the same public parts:
``RendezvousParameters``, the handler registry, ``WorkerSpec``, and ``ChildFailedError`` for the
root-cause report. Behaviour kept from torch: signals are forwarded to the workers, and the
rendezvous is not closed when the agent dies from a signal (so the run can still scale).
"""

from __future__ import annotations

import logging
import os
import tempfile
import uuid
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec, WorkerState
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port, _get_entrypoint_name

from ..checkpoint import owners
from ..checkpoint.node_memory import remove_node_memory, run_memory_dir
from ..rendezvous.handler import ElasticRMRendezvousHandler
from ..rendezvous.registration import node_services, register
from ..rendezvous.services import NodeServices
from ..rendezvous.session import NodeIdInUse
from ..train.world_sizes import ENV_NNODES
from .agent import AgentOptions, ElasticRMAgent

log = logging.getLogger(__name__)


def default_log_dir(config: LaunchConfig) -> str | None:
    """The torchelastic_* temporary directory torch makes for the workers' logs and error files when no
    --log-dir is given (torch leaves it behind after every run), else None. Only its look is checked: a
    --log-dir the user named may look the same, so callers ask this only when none was given. ermrun
    removes it at exit, the agent's watchdog after a SIGKILL (error files are read when a worker fails,
    before that)."""
    root = getattr(config.logs_specs, "root_log_dir", None)
    if root and os.path.dirname(os.path.abspath(root)) == tempfile.gettempdir():
        if os.path.basename(root).startswith("torchelastic_"):
            return root
    return None


def _remove_default_log_dir(agent: ElasticRMAgent, config: LaunchConfig) -> None:
    root = default_log_dir(config)
    if root is not None:
        agent.remove_on_exit(root)


def _claim_node_memory(agent: ElasticRMAgent, run_id: str) -> None:
    """Mark the run's node memory as in use by this agent (`erm gc` keeps it); the mark goes with the
    agent, however it ends (the node's own memory stays after a signal: a restart with the same
    --node-id restores from it)."""
    run_dir = run_memory_dir(run_id)
    claim = owners.claim(run_dir)
    if claim is not None:
        agent.remove_on_exit(str(claim), prune=(str(claim.parent), str(run_dir)))


class LeftBeforeWorkers(SignalException):
    """A signal (SIGTERM: a launcher's or Slurm's stop) reached a node the run does not need: it never
    started its workers (a spare), it stopped them for a new round, or the run's newest round leaves it
    out (a node given back or replaced as a straggler). It left the rendezvous and stopped its processes,
    and the run goes on without it; not a failure, so ermrun exits 0 (Slurm then records the node's job
    COMPLETED, not FAILED)."""

    def __init__(self, msg: str, sigval, when: str) -> None:
        super().__init__(msg, sigval)
        self.when = when  # "before its workers started", ...


def not_needed(state: WorkerState, services: NodeServices | None, node_id: str) -> str | None:
    """Why a signal that reaches this node leaves the run without a failure (None: it is a member whose
    workers run). The newest round is the one this node's watch of the run sees."""
    if state == WorkerState.INIT:
        return "before its workers started"
    newest = services.pending_round if services is not None else None
    if newest is not None and node_id not in newest.members:
        return "after the run's newest round left it out"
    if state == WorkerState.STOPPED:
        return "while its workers were stopped for a new round"
    return None


def closed_outcome(status: str) -> str:
    """The outcome a node that closes the run records (ClosedRecord.outcome), from its job's status."""
    if status == "succeeded":
        return "succeeded"
    if status.startswith("failed"):
        return "failed"
    return "stopped" if status.startswith("stopped") else ""


def free_node_memory(run_id: str, agent: ElasticRMAgent, why: str) -> None:
    """The run ended for this node: its in-memory checkpoint copies only hold RAM now (durable copies
    stay)."""
    freed = [node for node in agent.node_ids_used if remove_node_memory(run_id, node)]
    if freed:  # every id this node had: a rejoin (lease lost) wrote under a new one
        names = ", ".join(freed)
        agent.events.emit(
            "job",
            f"node {agent.node_id_now()}: node memory freed ({why}; of {names})",
            status="memory freed",
            nodes=freed,
        )


def mirror_final_ledger(agent: ElasticRMAgent) -> None:
    """The leader's etcd copy of the sample ledger as of the final checkpoint (the job's end, or `erm
    stop`'s drain), which the metrics loop, stopped by then, would have written a second later: `erm
    status`' data line then ends where training ended."""
    if agent.ledger_mirror is None:
        return
    try:
        agent.ledger_mirror.poll()
    except Exception as exc:  # noqa: BLE001 - a finished job must not fail on its epilogue
        log.warning("could not mirror the final sample ledger: %r", exc)


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable | str | None,
    args: list[Any],
    options: AgentOptions | None = None,
    on_agent: Callable[[ElasticRMAgent], None] | None = None,
    started_at: float | None = None,
    remove_log_dir: bool = False,
) -> dict[int, Any]:
    """Run this node's agent until the job ends; the workers' return values by global rank.
    ``on_agent`` sees the agent before it starts (ermrun attaches its progress printer); ``started_at``:
    when the process started (ermrun's first line), said in the node's first event. ``remove_log_dir``:
    the log directory is torch's temporary one (no --log-dir was given), which the agent's watchdog
    removes after a SIGKILL; only the caller knows, since a --log-dir may look like one."""
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("no --rdzv-id given; using a random run id %s", config.run_id)
    register()  # in case the package's entry points are not installed (running from a source tree)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    os.environ[ENV_NNODES] = f"{config.min_nodes}:{config.max_nodes}"  # the worlds workers may see
    handler = rdzv_registry.get_rendezvous_handler(params)
    services = node_services(handler)  # None under torch's own backends
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
    )
    try:
        agent = ElasticRMAgent(
            spec=spec,
            services=services,
            logs_specs=config.logs_specs,  # type: ignore[arg-type]
            start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template,
            shutdown_timeout=config.shutdown_timeout,  # type: ignore[arg-type]
            options=options or AgentOptions(),
        )
    except BaseException:
        # (a --metrics-port in use, say) the handler's threads would go on warning until the process
        # ends; released, not shut down: a node that never ran must not close the run for the others
        if services is not None:
            services.release()
        raise
    if on_agent is not None:
        on_agent(agent)
    if remove_log_dir:
        _remove_default_log_dir(agent, config)
    _claim_node_memory(agent, config.run_id)
    name = _get_entrypoint_name(entrypoint, args)
    agent.events.emit(
        "job",
        f"started {name} on node {agent.node_id}: {config.nproc_per_node} worker(s), "
        f"{config.min_nodes}-{config.max_nodes} node(s)",
        status="started",
        entrypoint=name,
        nproc=config.nproc_per_node,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        process_started=started_at,  # its imports and set-up took from then until this event
    )
    close_rendezvous = True
    status = "failed"
    try:
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), config.event_log_handler)
        if result is None:  # torch: the run closed while this node waited (a standby at the job's end)
            status = "left: the run closed before this node was needed"
            free_node_memory(config.run_id, agent, "the run closed")
            return {}
        if result.is_failed():
            ranks = sorted(result.failures)
            status = f"failed (rank(s) {ranks})"
            free_node_memory(config.run_id, agent, "the job failed")
            raise ChildFailedError(name=name, failures=result.failures)
        stopped = agent.stop_reason  # `erm stop RUN` (elastic_rm.agent.stop)
        status = f"stopped by {stopped}" if stopped else "succeeded"
        if services is not None and not stopped:  # the warm start of the next run of this job (rank 0)
            try:
                services.record_history("completed")
            except Exception as exc:  # noqa: BLE001 - a finished job must not fail on its epilogue
                log.warning("could not record the run in history/: %s", exc)
        mirror_final_ledger(agent)  # before the node memory (its checkpoints) goes
        free_node_memory(config.run_id, agent, status)
        return result.return_values
    except ChildFailedError:
        raise
    except SignalException as exc:
        status = f"stopped by {exc.sigval.name}"
        close_rendezvous = False  # as torch: a signalled agent must not close the run for the others
        events.record(agent.get_event_failed(), config.event_log_handler)
        when = not_needed(agent.worker_state, services, agent.node_id_now())
        if when is not None:  # a spare never needed, or a node given back: the run goes on without it
            # Its node memory is left as it is: what it holds (or what an earlier agent with the same node
            # id left: a Slurm node's name comes back) may be a restore's source, as after any signal.
            status += f" {when}"
            raise LeftBeforeWorkers(str(exc), exc.sigval, when) from exc
        raise
    except NodeIdInUse:
        close_rendezvous = False  # the run, and this node id in it, are another live process's
        raise
    except Exception:
        events.record(agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        agent.events.emit("job", f"node {agent.node_id_now()}: job {status}", status=status)
        agent.events.flush()  # the etcd copy is written without waiting: let the last event land
        agent.close()
        agent.events.close()
        if close_rendezvous and isinstance(handler, ElasticRMRendezvousHandler):
            handler.shutdown(outcome=closed_outcome(status))
        elif close_rendezvous:
            handler.shutdown()  # torch's own backends
        elif services is not None:
            services.release()  # leave without closing the run (torch's backends keep theirs as torch does)
