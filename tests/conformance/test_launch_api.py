"""torch's elastic_launch (torch.distributed.launcher.api) over elastic-rm, with c10d as the baseline
(scenarios of torch's launcher/api_test.py; see README.md here)."""

from __future__ import annotations

import multiprocessing as mp
import os
import uuid

import pytest
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from elastic_rm.rendezvous.registration import register

from . import entrypoints as ep
from .agents import free_endpoint

pytestmark = pytest.mark.slow
BACKENDS = ["c10d", "elastic-rm"]


def config(
    backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, nproc: int, logs: str
) -> LaunchConfig:
    """``logs``: the workers' log directory (without one, torch makes a torchelastic_* directory in /tmp
    and leaves it there)."""
    conf = {"join_timeout": "60"} if backend == "elastic-rm" else {"timeout": "60"}
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=conf,
        monitor_interval=0.2,
        start_method="spawn",
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=logs),
    )


def launch(
    backend: str, endpoint: str, run_id: str, min_nodes: int, max_nodes: int, nproc: int, d: str
) -> dict:
    register()
    logs = f"{d}-logs"  # beside ``d``, which holds only the workers' rank files
    return elastic_launch(
        config(backend, endpoint, run_id, min_nodes, max_nodes, nproc, logs), ep.touch_rank
    )(d)


def endpoint_for(backend: str, etcd) -> str:
    return etcd.endpoint if backend == "elastic-rm" else free_endpoint()


@pytest.mark.parametrize("backend", BACKENDS)
def test_launch_one_node(backend, etcd, tmp_path):
    """torch: test_launch_script_python / test_launch_function (4 workers there, 2 here)."""
    got = launch(backend, endpoint_for(backend, etcd), uuid.uuid4().hex[:12], 1, 1, 2, str(tmp_path))
    assert got == {0: 0, 1: 1}
    assert sorted(os.listdir(tmp_path)) == ["0-of-2", "1-of-2"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_launch_elastic_multiple_agents(backend, etcd, tmp_path):
    """torch: test_launch_elastic_multiple_agents: --nnodes 1:2, a second agent in a spawned process.
    The two may share one round (world 4) or the first may finish alone before the second arrives; a
    node that arrives after the run finished exits 0 (elastic-rm says why in its log). Every round that
    ran covered all its ranks, and both launches end without an error."""
    endpoint, run_id = endpoint_for(backend, etcd), uuid.uuid4().hex[:12]
    ctx = mp.get_context("spawn")
    other = ctx.Process(target=launch, args=(backend, endpoint, run_id, 1, 2, 2, str(tmp_path)))
    other.start()
    mine = launch(backend, endpoint, run_id, 1, 2, 2, str(tmp_path))
    other.join(180)
    assert other.exitcode == 0
    assert set(mine.values()) in ({0, 1}, {2, 3}) or mine == {}
    worlds: dict[str, set[int]] = {}
    for name in os.listdir(tmp_path):
        rank, _, world = name.partition("-of-")
        worlds.setdefault(world, set()).add(int(rank))
    assert worlds and all(ranks == set(range(int(w))) for w, ranks in worlds.items()), worlds
