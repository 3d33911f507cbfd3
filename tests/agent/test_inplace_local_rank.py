"""The environment a worker kept in place gets for its new round is the one torch gives a new worker: under
``--virtual-local-rank`` each worker sees only its own GPU and torch gives it ``LOCAL_RANK=0``; the round
in place wrote the real local rank over it (``os.environ.update`` in the worker), so a round body that
picks its device by ``LOCAL_RANK`` asked for a device it cannot see."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.inplace import InPlaceRounds
from elastic_rm.checkpoint.peers import PEERS_ENV
from elastic_rm.obs.events import EventLog


class _Handler:
    def get_run_id(self) -> str:
        return "run-1"


class _Agent:
    services = None
    node_id = "n0"
    remaining_restarts = 3


@pytest.mark.parametrize("virtual, expected", [(True, ["0", "0"]), (False, ["0", "1"])])
def test_a_kept_workers_local_rank_is_torchs(virtual, expected, monkeypatch, tmp_path):
    monkeypatch.setenv(PEERS_ENV, "")  # the round sets it (none without node services); restored after
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=_Handler(),  # type: ignore[arg-type]
        entrypoint="python",
        max_restarts=3,
        virtual_local_rank=virtual,
    )
    group = WorkerGroup(spec)
    for w in group.workers:
        w.global_rank = w.role_rank = 2 + w.local_rank
        w.world_size = w.role_world_size = 4
    group.group_rank, group.group_world_size = 1, 2
    group.master_addr, group.master_port = "10.0.0.1", 29500
    with AgentChannel(window_s=5.0) as channel:
        rounds = InPlaceRounds(channel, EventLog("run-1", "n0"))
        envs = rounds._environments(_Agent(), group, round_id=4)  # type: ignore[arg-type]
    assert [envs[r]["LOCAL_RANK"] for r in (0, 1)] == expected
    assert [envs[r]["RANK"] for r in (0, 1)] == ["2", "3"]
