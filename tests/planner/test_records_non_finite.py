"""Values the leader reads from etcd that json.loads accepts but no writer produces: NaN, Infinity and
integers too large for a float, in a queue record, a round record and a job-history record."""

from __future__ import annotations

import json
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.planner.history import HistoryError, parse_record
from elastic_rm.planner.interface import ClusterSnapshot
from elastic_rm.planner.job import parse_job
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.rendezvous.queue_signal import QueueSignal
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import (
    QUEUE_STALE_AFTER_S,
    ClosedRecord,
    DemandRecord,
    LedgerRecord,
    QueueRecord,
    RecordError,
    RefusedRecord,
    RoundRecord,
)

from .helpers import JOB, node

HUGE = int("9" * 400)  # a JSON integer json.loads reads, float() cannot


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_queue_record_with_a_nan_time_still_goes_stale(etcd):
    """NaN != NaN: a record whose time was NaN never equalled the last one read, so a dead writer's count
    reached the planner forever (and its running_nodes held the first round). It is malformed now."""
    keys = Keyspace("/elastic-rm", f"queue-nan-{time.monotonic_ns()}")
    clock = Clock()
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        signal = QueueSignal(client, keys, every_s=1.0, clock=clock)
        client.put(keys.queue, b'{"v":1,"waiting_nodes":3,"running_nodes":4,"time":NaN}')
        for _ in range(5):
            clock.now += QUEUE_STALE_AFTER_S
            assert signal.waiting_nodes() is None
            assert signal.running_nodes() == 0


def test_a_queue_record_with_a_huge_time_is_a_record_error_not_a_crash(etcd):
    """float() of a 400-digit time raised OverflowError past QueueSignal's RecordError handler, into the
    leader's loop ("round policy failed; retrying"): no round was ever decided."""
    keys = Keyspace("/elastic-rm", f"queue-huge-{time.monotonic_ns()}")
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        signal = QueueSignal(client, keys, every_s=1.0, clock=Clock())
        client.put(keys.queue, b'{"v":1,"waiting_nodes":3,"time":%d}' % HUGE)
        assert signal.waiting_nodes() is None


@pytest.mark.parametrize("bad", [HUGE, float("nan"), float("inf")], ids=["huge", "nan", "inf"])
@pytest.mark.parametrize(
    "cls, base",
    [
        (RoundRecord, {"v": 1, "round": 2, "members": ["a"]}),
        (DemandRecord, {"v": 1, "target_nodes": 2}),
        (QueueRecord, {"v": 1, "waiting_nodes": 2}),
        (ClosedRecord, {"v": 1, "by": "a"}),
        (RefusedRecord, {"v": 1, "reporter": "a", "lease": 1}),
        (
            LedgerRecord,
            {"v": 1, "step": 1, "epoch": 0, "samples_done": 1, "epoch_samples": 2, "node": "n", "ledger": {}},
        ),
    ],
)
def test_a_non_finite_time_is_a_record_error_naming_the_field(cls, base, bad):
    raw = json.dumps(base | {"time": bad}).encode()
    with pytest.raises(RecordError, match="'time' must be a finite number"):
        cls.parse("k", raw)


@pytest.mark.parametrize("bad", [HUGE, float("nan"), float("inf")], ids=["huge", "nan", "inf"])
def test_a_round_with_a_non_finite_gain_reads_as_unknown(bad):
    raw = json.dumps({"v": 1, "round": 2, "members": ["a"], "predicted_gain": bad, "confidence": bad})
    r = RoundRecord.parse("k", raw.encode())
    assert (r.predicted_gain, r.confidence, r.members) == (None, None, ("a",))
    with pytest.raises(RecordError, match="'confidence' must be a number"):
        RoundRecord.parse("k", b'{"v":1,"round":2,"members":["a"],"confidence":true}')


def _history(**kw) -> dict:
    d = {
        "v": 1,
        "signature": parse_job(JOB).signature(),
        "run_id": "r",
        "finished_at": 1,
        "status": "completed",
        "world_size": 3,
        "throughput": 5,
        "cpu_per_node_used": 1,
        "mem_per_node_peak_bytes": 1,
        "coef": [],
    }
    return d | kw


@pytest.mark.parametrize("coef", ["[NaN,1,1,1]", "[Infinity,1,1,1]", f"[{HUGE},1,1,1]"])
def test_a_history_record_with_a_non_finite_coefficient_is_malformed(coef):
    """NaN < 0 is False: a NaN coefficient passed and became the warm start's model prior."""
    d = json.loads(json.dumps(_history()).replace('"coef": []', f'"coef": {coef}'))
    with pytest.raises(HistoryError, match="'coef' must hold finite non-negative numbers"):
        parse_record(d)
    snap = ClusterSnapshot(0.0, 1, 8, 0.0, (node("a", 1, state="joining"),), job=JOB, history=(d,))
    policy = PlannerPolicy()
    policy.decide(snap)
    assert policy.state.start.coef == () and not policy.state.start.warm


def test_a_history_record_with_a_huge_number_is_malformed_not_a_leader_crash():
    """math.isfinite(10**400) raises OverflowError; the planner skips only HistoryError, so the leader's
    policy raised on every try and no first round was decided."""
    d = _history(throughput=HUGE)
    with pytest.raises(HistoryError, match="'throughput' must be a finite number"):
        parse_record(d)
    snap = ClusterSnapshot(0.0, 1, 8, 0.0, (node("a", 1, state="joining"),), job=JOB, history=(d,))
    assert PlannerPolicy().decide(snap).members == ("a",)
