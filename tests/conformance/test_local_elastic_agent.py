"""torch's LocalElasticAgent over elastic-rm, with c10d as the baseline (scenarios of torch's
local_elastic_agent_test.py; see README.md here). Agents run in processes of their own."""

from __future__ import annotations

import pytest

from elastic_rm.etcd.client import EtcdClient

from . import entrypoints as ep
from .agents import Node, free_endpoint, run_agent, run_job

pytestmark = pytest.mark.slow
BACKENDS = ["c10d", "elastic-rm"]


def endpoint_for(backend: str, etcd) -> str:
    return etcd.endpoint if backend == "elastic-rm" else free_endpoint()


def assert_rank_consistency(results, role_world_sizes: dict[str, int]) -> None:
    """Global ranks 0..W-1 once each, role ranks 0..R-1 per role, and consecutive ranks on each node."""
    world = sum(role_world_sizes.values())
    ranks, role_ranks = [], {role: [] for role in role_world_sizes}
    for role, failed, values in results:
        assert not failed
        node_ranks, node_role_ranks = [], []
        for rank, (r, role_rank, _group, role_world, world_size) in values.items():
            assert (rank, world_size, role_world) == (r, world, role_world_sizes[role])
            ranks.append(r)
            role_ranks[role].append(role_rank)
            node_ranks.append(r)
            node_role_ranks.append(role_rank)
        for seq in (sorted(node_ranks), sorted(node_role_ranks)):
            assert seq == list(range(seq[0], seq[0] + len(seq)))
    assert sorted(ranks) == list(range(world))
    for role, size in role_world_sizes.items():
        assert sorted(role_ranks[role]) == list(range(size))


@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_sum_homogeneous(backend, etcd, run_id):
    """torch: run_distributed_sum_homogeneous (4 workers per node there, 2 here)."""
    results = run_job(backend, endpoint_for(backend, etcd), run_id, [Node(ep.dist_sum, 2)] * 2)
    assert [failed for _, failed, _ in results] == [False, False]
    assert all(v == 0 + 1 + 2 + 3 for _, _, values in results for v in values.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_distributed_sum_heterogeneous(backend, etcd, run_id):
    """torch: run_distributed_sum_heterogeneous (local world sizes 1, 2, 3: world 6)."""
    nodes = [Node(ep.dist_sum, n) for n in (1, 2, 3)]
    results = run_job(backend, endpoint_for(backend, etcd), run_id, nodes)
    assert sorted(len(values) for _, _, values in results) == [1, 2, 3]
    assert all(v == sum(range(6)) for _, failed, values in results for v in values.values() if not failed)
    assert not any(failed for _, failed, _ in results)


@pytest.mark.parametrize("backend", BACKENDS)
def test_correct_rank_assignment(backend, etcd, run_id):
    """torch: correct_rank_assignment_homogeneous/heterogeneous (23 and 25 workers there: more than 2
    cores carry, so one mixed job of 6 workers with three roles here)."""
    nodes = [
        Node(ep.role_info, 1, role="master"),
        Node(ep.role_info, 2, role="trainer"),
        Node(ep.role_info, 1, role="trainer"),
        Node(ep.role_info, 2, role="ps"),
    ]
    results = run_job(backend, endpoint_for(backend, etcd), run_id, nodes)
    assert sorted(role for role, _, _ in results) == ["master", "ps", "trainer", "trainer"]
    assert_rank_consistency(results, {"master": 1, "trainer": 3, "ps": 2})


@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_drift_success(backend, etcd, run_id):
    """torch: run_agent_workers_drift_success: the early node waits in the exit barrier, both succeed."""
    nodes = [Node(ep.drift_success, 1)] * 2
    results = run_job(backend, endpoint_for(backend, etcd), run_id, nodes)
    assert [failed for _, failed, _ in results] == [False, False]
    assert sorted(v for _, _, values in results for v in values.values()) == [0, 1]


@pytest.mark.parametrize("backend", BACKENDS)
def test_workers_drift_fail(backend, etcd, run_id):
    """torch: run_agent_workers_drift_fail: the late node fails, the early one had succeeded."""
    nodes = [Node(ep.drift_fail, 1)] * 2
    results = run_job(backend, endpoint_for(backend, etcd), run_id, nodes)
    assert sorted(failed for _, failed, _ in results) == [False, True]


@pytest.mark.parametrize("backend", BACKENDS)
def test_forked_agents_after_an_agent_in_this_process(backend, etcd, run_id):
    """The order that failed in torch's suite: an agent runs in the test process (its handler shut down),
    then agents are forked from it (multiprocessing's default start method on Linux) while this process
    still holds an open etcd client with a watch: the forked agents use etcd's JSON gateway."""
    role, failed, values = run_agent(
        backend, endpoint_for(backend, etcd), f"{run_id}-a", Node(ep.role_info, 1), 1, True
    )
    assert (role, failed, sorted(values)) == ("default", False, [0])
    with EtcdClient(etcd.endpoint, timeout=5) as held:
        held.put(f"/{run_id}-held", "x")
        cancel = held.watch_prefix(f"/{run_id}-held", 1, lambda events: None)
        results = run_job(
            backend,
            endpoint_for(backend, etcd),
            f"{run_id}-b",
            [Node(ep.dist_sum, 1)] * 2,
            start_method="fork",
        )
        cancel()
    assert [failed for _, failed, _ in results] == [False, False]
    assert all(v == 1 for _, _, values in results for v in values.values())
