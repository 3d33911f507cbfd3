"""A held failure (rounds in place after a lost peer), the worker's iterator against the agent's
bookkeeping over a real channel, with a real gloo process group of one: the body's exception inside
``with rnd:`` is held, the agent hears that the worker waits, and the worker either joins the round the
agent hands it (a new process group, the next index) or, released, fails with the held text."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.inplace import InPlaceRounds
from elastic_rm.etcd.server import free_port
from elastic_rm.obs.events import EventLog
from elastic_rm.train.report import StepReporter
from elastic_rm.train.rounds import rounds
from elastic_rm.wire.channel import ENV_AGENT_DIR, ROUND_JOIN

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hold_worker.py")


@pytest.fixture
def one_rank(monkeypatch):
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "GROUP_WORLD_SIZE": "2",
        "ERM_ROUND": "4",
    }
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
    # the worker runs apart: holding a failure shuts down its process's TCP connections
    with AgentChannel(str(tmp_path / "ch")) as channel:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        env = {**os.environ, ENV_AGENT_DIR: channel.directory, "PYTHONPATH": REPO}
        proc = subprocess.Popen([sys.executable, WORKER], env=env, stdout=subprocess.PIPE, text=True)
        try:
            wait_held(agent, proc.pid)  # round 4 failed: hand the worker round 5 (a new store port)
            with agent._cond:
                agent._lost.pop(proc.pid)
            channel.send_round(proc.pid, ROUND_JOIN, 5, {"MASTER_PORT": str(free_port()), "ERM_ROUND": "5"})
            wait_held(agent, proc.pid)  # round 5 failed too: no newer round comes
            why = agent.release([proc.pid])
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait()
        assert proc.returncode == 3, out
        got = json.loads(out)
        assert got["seen"] == [[0, 4, False, 1], [1, 5, True, 1]]
        assert "round 5 failed and no new round came: RuntimeError: second failure" in got["error"]
        assert not got["initialized"]  # the failed round's groups are gone
        assert "round 5: RuntimeError: second failure" in why
        assert agent.waiting_s([proc.pid]) is None  # released: nothing waits any more


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
