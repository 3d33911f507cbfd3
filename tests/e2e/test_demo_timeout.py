"""A demo phase that times out says what the leader decided instead and how loaded the machine was: on a
busy machine a member measures slow and the planner may replace it as a straggler where the scenario
waits for a scale-up (seen on 2 cores right after the test suite)."""

from __future__ import annotations

import pytest

from elastic_rm.demo.scenario import Scenario
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.events import EventLog
from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace


def test_a_timed_out_phase_names_the_decision_taken_instead_and_the_load(etcd, tmp_path):
    scenario = Scenario(workdir=str(tmp_path), phase_timeout=0.5)
    scenario.etcd = etcd
    keys = Keyspace(DEFAULT_PREFIX, scenario.demo.run_id)
    with EtcdClient(etcd.endpoint, timeout=2) as client:
        log = EventLog(scenario.demo.run_id, "node-b", client=client, keys=keys)

        emitted = []

        def straggler_swap_meanwhile(_rows):
            if not emitted:  # once, after the wait began
                emitted.append(True)
                log.emit(
                    "decision",
                    "round 2",
                    round=2,
                    members=["node-b", "node-c"],
                    reason="straggler(s) node-a replaced by node-c",
                )
                assert log.flush()
            return False

        with pytest.raises(TimeoutError) as caught:
            scenario.wait_for(straggler_swap_meanwhile, "the planner's scale-up decision")
    message = str(caught.value)
    assert message.startswith("the planner's scale-up decision did not happen within 0s; "), message
    assert "the leader decided instead: round 2: straggler(s) node-a replaced by node-c" in message
    assert "load average" in message and "idle machine" in message and str(tmp_path) in message


def test_a_timed_out_phase_says_when_the_leader_decided_nothing(etcd, tmp_path):
    scenario = Scenario(workdir=str(tmp_path), phase_timeout=0.3)
    scenario.etcd = etcd
    with pytest.raises(TimeoutError, match="the leader decided nothing meanwhile; load average"):
        scenario.wait_for(lambda rows: False, "training at world 2")
