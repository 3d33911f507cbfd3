"""A held failure (rounds in place after a lost peer), the worker's iterator against the agent's
bookkeeping over a real channel, with a real gloo process group of one: the body's exception inside
``with rnd:`` is held, the agent hears that the worker waits, and the worker either joins the round the
agent hands it (a new process group, the next index) or, released, fails with the held text."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch.distributed as dist

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.inplace import InPlaceRounds
from elastic_rm.etcd.server import free_port
from elastic_rm.obs.events import EventLog
from elastic_rm.train.report import StepReporter
from elastic_rm.train.rounds import RoundFailedError, rounds
from elastic_rm.wire.channel import ROUND_JOIN


@pytest.fixture
def one_rank(monkeypatch):
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "GROUP_WORLD_SIZE": "2", "ERM_ROUND": "4"}  # fmt: skip
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def wait_held(agent: InPlaceRounds, pid: int, limit: float = 30.0) -> float:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        waited = agent.waiting_s([pid])
        if waited is not None:
            return waited
        time.sleep(0.01)
    raise AssertionError("the worker never said that it waits in place")


def test_a_held_failure_joins_the_next_round_in_place_or_fails_when_released(tmp_path, one_rank):
    with AgentChannel(str(tmp_path / "ch")) as channel:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        rep = StepReporter(agent_dir=channel.directory)
        me = os.getpid()
        told: list[str] = []

        def agent_side() -> None:
            wait_held(agent, me)  # round 4 failed: hand the worker round 5 (a new store port)
            with agent._cond:
                agent._lost.pop(me)
            agent._tell(me, ROUND_JOIN, 5, {"MASTER_PORT": str(free_port()), "ERM_ROUND": "5"})
            told.append("join")
            wait_held(agent, me)  # round 5 failed too: no newer round comes
            told.append(agent.release([me]))

        thread = threading.Thread(target=agent_side, daemon=True)
        thread.start()
        seen = []
        with pytest.raises(RoundFailedError, match="round 5 failed and no new round came: .*second failure"):
            for rnd in rounds(rep):
                seen.append((rnd.index, rnd.round_id, rnd.in_place, dist.get_world_size()))
                with rnd:
                    raise RuntimeError("Connection reset by peer" if rnd.index == 0 else "second failure")
        thread.join(10)
        assert seen == [(0, 4, False, 1), (1, 5, True, 1)]
        assert told[0] == "join" and "round 5: RuntimeError: second failure" in told[1]
        assert not dist.is_initialized()  # the failed round's groups are gone
        assert agent.waiting_s([me]) is None  # released: nothing waits any more
        rep.close()


def test_alone_or_without_an_agent_the_exception_propagates(tmp_path, one_rank, monkeypatch):
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # a world of this node alone: no peer can have been lost
    with AgentChannel(str(tmp_path / "ch")) as channel:
        rep = StepReporter(agent_dir=channel.directory)
        with pytest.raises(RuntimeError, match="a bug"):
            for rnd in rounds(rep):
                with rnd:
                    raise RuntimeError("a bug")
        rep.close()
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    dist.destroy_process_group()
    rep = StepReporter(agent_dir=None)  # plain torchrun
    with pytest.raises(RuntimeError, match="no agent"):
        for rnd in rounds(rep):
            with rnd:
                raise RuntimeError("no agent")
