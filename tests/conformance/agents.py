"""Runs torch's LocalElasticAgent (torch's own, not ours) over a rendezvous backend, one agent per process,
as torch's conformance suite does: the backend under test is the only thing that changes."""

from __future__ import annotations

import multiprocessing as mp
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous import registry as rdzv_registry

from elastic_rm.rendezvous.registration import register


@dataclass(frozen=True)
class Node:
    entrypoint: Callable
    local_world_size: int
    role: str = "default"


def free_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def run_agent(
    backend: str, endpoint: str, run_id: str, node: Node, nnodes: int, is_host: bool, max_restarts: int = 0
) -> tuple[str, bool, dict[int, object]]:
    """One node: (role, failed, return values by global rank)."""
    register()
    params = RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=nnodes,
        max_nodes=nnodes,
        is_host=is_host,
        join_timeout=60,
    )
    handler = rdzv_registry.get_rendezvous_handler(params)
    spec = WorkerSpec(
        role=node.role,
        local_world_size=node.local_world_size,
        entrypoint=node.entrypoint,
        args=(),
        rdzv_handler=handler,
        max_restarts=max_restarts,
        monitor_interval=0.05,
    )
    # torch.multiprocessing leaves a failed worker's ``pytorch-errorfile-*.pickle`` in the temporary
    # directory (it reads the file, never removes it): keep it in a directory that goes with the agent
    saved_tempdir = tempfile.tempdir
    with tempfile.TemporaryDirectory(prefix="erm-conf-") as logs:
        agent = LocalElasticAgent(
            spec, start_method="spawn", exit_barrier_timeout=5, logs_specs=DefaultLogsSpecs(log_dir=logs)
        )
        tempfile.tempdir = logs
        try:
            result = agent.run()
        finally:
            tempfile.tempdir = saved_tempdir
            handler.shutdown()
    return node.role, result.is_failed(), dict(result.return_values)


def _agent_process(queue, *args) -> None:
    queue.put(run_agent(*args))


def run_job(
    backend: str,
    endpoint: str,
    run_id: str,
    nodes: list[Node],
    start_method: str = "spawn",
    timeout_s: float = 240,
) -> list[tuple[str, bool, dict[int, object]]]:
    """One agent process per node (node 0 hosts c10d's store); each agent's result."""
    ctx = mp.get_context(start_method)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_agent_process, args=(queue, backend, endpoint, run_id, node, len(nodes), i == 0))
        for i, node in enumerate(nodes)
    ]
    for p in procs:
        p.start()
    results = []
    deadline = time.monotonic() + timeout_s
    while len(results) < len(procs) and time.monotonic() < deadline:
        try:
            results.append(queue.get(timeout=1))
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"an agent process died with {dead} before reporting (see its output above)"
    assert len(results) == len(procs), f"{len(results)} of {len(procs)} agents reported within {timeout_s} s"
    for p in procs:
        p.join(30)
        if p.exitcode is None:
            p.kill()
            p.join(5)
        assert p.exitcode == 0, f"agent process exited with {p.exitcode}"
    return results
