"""Rounds in place, the parts without a world: the round message format, the agent's bookkeeping of
which workers opted in and resumed (real datagrams over a real channel), and the reporter's new round."""

from __future__ import annotations

import os
import time

import pytest

from elastic_rm.agent.channel import AgentChannel, DrainResult
from elastic_rm.agent.inplace import InPlaceRounds
from elastic_rm.obs.events import EventLog
from elastic_rm.train.report import StepReporter
from elastic_rm.wire.channel import (
    KIND_FAILED,
    KIND_INPLACE,
    KIND_RESUMED,
    RESUMED,
    ROUND,
    ROUND_JOIN,
    ROUND_LEAVE,
    decode_round,
    encode_round,
)


def test_round_message_round_trips_and_rejects_what_it_cannot_carry():
    env = {"RANK": "2", "MASTER_ADDR": "10.0.0.1", "ELASTIC_RM_CKPT_PEERS": '{"v": 1, "peers": []}', "E": ""}
    assert decode_round(encode_round(ROUND_JOIN, 7, env)) == (ROUND_JOIN, 7, env)
    assert decode_round(encode_round(ROUND_LEAVE, 8, {})) == (ROUND_LEAVE, 8, {})
    for bad in ({"A=B": "1"}, {"": "1"}, {"A": "x\0y"}):
        with pytest.raises(ValueError, match="cannot be sent"):
            encode_round(ROUND_JOIN, 1, bad)
    with pytest.raises(ValueError, match="ROUND_JOIN, ROUND_LEAVE or ROUND_FAIL"):
        encode_round(9, 1, {})
    data = encode_round(ROUND_JOIN, 3, {"RANK": "0"})
    for broken in (data[:4], data[:-1], b"\x00\x00" + data[2:], data[: ROUND.size - 1]):
        with pytest.raises(ValueError):
            decode_round(broken)


def _drained(pids, acked=None) -> DrainResult:
    acked = {p: 10 for p in pids} if acked is None else acked
    return DrainResult(acked=acked, failed={}, exited=(), missing=(), unregistered=(), elapsed_s=0.1)


def test_the_agent_takes_a_round_in_place_only_when_every_worker_opted_in_and_drained(tmp_path):
    os.environ.pop("ELASTIC_RM_AGENT_DIR", None)
    with AgentChannel(str(tmp_path / "ch")) as channel:
        rounds = InPlaceRounds(channel, EventLog("run", "node"))
        rep = StepReporter(agent_dir=channel.directory)
        me = os.getpid()
        assert "do not use elastic_rm.train.rounds" in rounds.why_not([me], _drained([me]))
        rep.send(KIND_INPLACE)
        deadline = time.monotonic() + 5
        while rounds.why_not([me], _drained([me])) is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rounds.why_not([me], _drained([me])) is None
        assert "drained cleanly" in rounds.why_not([me], _drained([me], acked={}))
        assert rounds.why_not([me], None) == "the workers were not drained"
        assert "do not use" in rounds.why_not([me, me + 1], _drained([me, me + 1]))

        # resumed and failed reports, as the agent waits for them
        rep.send(KIND_RESUMED, RESUMED.pack(5))
        assert rounds._wait_resumed([me], 5, lambda: False) is None
        rep.send(KIND_FAILED, RESUMED.pack(6) + b"RuntimeError: no route to master")
        why = rounds._wait_resumed([me], 6, lambda: False)
        assert why is not None and "raised while re-initialising" in why and "no route to master" in why
        rounds._failed.clear()
        why = rounds._wait_resumed([me], 7, lambda: True)
        assert why is not None and "a newer round formed" in why
        rep.close()


def test_the_channel_writes_each_worker_its_round_whole(tmp_path):
    with AgentChannel(str(tmp_path / "ch")) as channel:
        channel.send_round(1234, ROUND_JOIN, 4, {"RANK": "1", "WORLD_SIZE": "3"})
        with open(os.path.join(channel.directory, "round-1234"), "rb") as fh:
            assert decode_round(fh.read()) == (ROUND_JOIN, 4, {"RANK": "1", "WORLD_SIZE": "3"})
        assert sorted(os.listdir(channel.directory)) == ["agent.sock", "control", "round-1234"]


def test_a_new_round_restarts_the_reporters_step_count_and_rank(tmp_path, monkeypatch):
    with AgentChannel(str(tmp_path / "ch")) as channel:
        rep = StepReporter(agent_dir=channel.directory)
        for _ in range(7):
            rep.step(1)
        rep._stopping = True
        monkeypatch.setenv("RANK", "4")
        seen = []
        rep.new_round(after_first_step=lambda: seen.append(rep.completed_steps))
        assert rep.completed_steps == 0 and not rep.should_stop() and rep._rank == 4
        rep.step(1)
        rep.step(1)
        assert seen == [1]  # once, after the round's first step
        # the hello of the new round carries the new rank: wait for it to be read, not for any hello (the
        # reporter's first, of rank -1, was there already)
        deadline = time.monotonic() + 30
        while (w := channel.workers().get(os.getpid())) is None or w.rank != 4:
            assert time.monotonic() < deadline, f"the new round's hello never arrived: {w}"
            time.sleep(0.01)
        rep.close()
