"""Hostile values in etcd: every record parser either returns a record or raises RecordError naming the
key."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rm.planner.interface import NodeState
from elastic_rm.wire.records import AckRecord, ClosedRecord, NodeRecord, RecordError, RoundRecord

KEY = "/elastic-rm/run/some-key"
PARSERS = (NodeRecord.parse, RoundRecord.parse, AckRecord.parse, ClosedRecord.parse)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=10), inner, max_size=6),
    max_leaves=30,
)
fields = st.sampled_from(
    [
        "v",
        "node",
        "host",
        "addr",
        "pid",
        "nproc",
        "state",
        "round",
        "members",
        "standby",
        "sealed",
        "master",
        "reason",
        "predicted_gain",
        "confidence",
        "time",
        "by",
        "extra",
        "master_port",
    ]
)
records = st.dictionaries(fields, json_values, max_size=12).map(lambda d: {**d, "v": d.get("v", 1)})


def check(parse, raw: bytes) -> None:
    try:
        parse(KEY, raw)
    except RecordError as exc:
        assert KEY in str(exc)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(records)
def test_structured_garbage_is_a_record_error(record):
    raw = json.dumps(record, allow_nan=True).encode()
    for parse in PARSERS:
        check(parse, raw)


@settings(max_examples=200)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_a_record_error(raw):
    for parse in PARSERS:
        check(parse, raw)


def test_absurd_nesting_and_huge_numbers_are_record_errors():
    for raw in (b"[" * 200_000 + b"]" * 200_000, b'{"v": 1, "round": ' + b"9" * 5000 + b"}"):
        for parse in PARSERS:
            check(parse, raw)


def test_a_valid_round_survives_the_round_trip():
    from elastic_rm.wire.records import RoundRecord as R

    r = R(round=3, members=("a", "b"), standby=("c",), reason="x", sealed=True, master=("h", 1234))
    assert R.parse(KEY, r.to_json()) == r
    assert r.phase == "sealed" and r.took_effect
    assert R(round=4, members=("a",)).phase == "forming" and not R(round=4, members=("a",)).took_effect
    assert R(round=5, members=()).phase == "suspended"


@given(st.text(max_size=12))
def test_a_node_state_is_one_of_the_vocabulary(state):
    raw = json.dumps({"v": 1, "node": "a", "host": "h", "addr": "x", "pid": 1, "nproc": 1, "state": state})
    try:
        record = NodeRecord.parse(KEY, raw.encode())
    except RecordError as exc:
        assert state not in ("joining", "active", "standby") and "unknown node state" in str(exc)
    else:
        assert record.state == state and isinstance(record.state, NodeState)
