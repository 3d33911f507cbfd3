"""A prepared start's prediction against torch's own code: the ranks a joining node predicts for its
workers from the proposed round (member order, the members' ``nproc``) are the ranks torch's
``_assign_worker_ranks`` gives them once the round is sealed, with nodes of different sizes; the master is
rank 0's advertised address and port unless the command line names one (as in torch's ``_rendezvous``).
The end-to-end case (a scale-up whose joiner starts before the seal, and the fallback when the sealed
round differs) is in tests/e2e/test_inplace_rounds.py."""

from __future__ import annotations

import threading

import pytest
from torch.distributed import HashStore
from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

from elastic_rm.agent.prepared import predicted_group
from elastic_rm.planner.interface import NodeState
from elastic_rm.wire.records import NodeRecord, RoundRecord


def spec(nproc: int, **kwargs) -> WorkerSpec:
    return WorkerSpec(
        role="trainer", local_world_size=nproc, rdzv_handler=None, entrypoint="python", **kwargs
    )


def record(node: str, nproc: int, port: int) -> NodeRecord:
    return NodeRecord(node, "host", f"10.0.0.{port % 250}", 1, nproc, NodeState.JOINING, master_port=port)


def torch_ranks(nprocs: list[int]) -> list[list[tuple[int, int, int, int]]]:
    """torch's rank assignment for nodes of these sizes, each agent on a thread over one store."""
    store, out = HashStore(), [None] * len(nprocs)

    def agent(group_rank: int) -> None:
        workers = SimpleElasticAgent._assign_worker_ranks(
            None, store, group_rank, len(nprocs), spec(nprocs[group_rank])
        )
        out[group_rank] = [(w.global_rank, w.role_rank, w.world_size, w.role_world_size) for w in workers]

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(nprocs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(o is not None for o in out), out
    return out


@pytest.mark.parametrize("nprocs", [[1, 1, 1], [2, 1, 3], [4, 2]])
def test_predicted_ranks_are_the_ranks_torch_assigns(nprocs):
    members = tuple(f"n{i}" for i in range(len(nprocs)))
    records = {m: record(m, n, 29500 + i) for i, (m, n) in enumerate(zip(members, nprocs, strict=True))}
    r = RoundRecord(round=7, members=members)
    expected = torch_ranks(nprocs)
    for index, node in enumerate(members):
        group = predicted_group(spec(nprocs[index]), r, records, node)
        got = [(w.global_rank, w.role_rank, w.world_size, w.role_world_size) for w in group.workers]
        assert got == expected[index], (node, got, expected[index])
        assert (group.group_rank, group.group_world_size) == (index, len(members))
        assert (group.master_addr, group.master_port) == (records["n0"].addr, 29500)


def test_a_master_given_on_the_command_line_wins_as_in_torch():
    records = {"a": record("a", 1, 29501), "b": record("b", 1, 29502)}
    group = predicted_group(
        spec(1, master_addr="10.9.9.9", master_port=1234), RoundRecord(3, ("a", "b")), records, "b"
    )
    assert (group.master_addr, group.master_port) == ("10.9.9.9", 1234)
