"""Hostile input: every JSON record elastic-rm reads from etcd, a file or the network, and the trace CSV and
the workers' struct datagrams, fed with property-based garbage (hypothesis).

The contract (docs/guarantees.md, "Hostile input"): a value that is not what we wrote is an error of the
parser's own type whose message names the source (the etcd key, the file, the manifest's place), never a
hang and never an uncaught exception of another type (KeyError, TypeError, RecursionError ...). The worker
channel drops and counts a bad datagram instead of raising (it must not kill the agent's receive thread).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.checkpoint.manifest import CorruptCheckpointError, entry_hash, make_manifest, parse_manifest
from elastic_rm.obs.events import Event, EventError
from elastic_rm.planner.history import HistoryError
from elastic_rm.planner.history import parse_record as parse_history
from elastic_rm.planner.job import JobSpecError, parse_job
from elastic_rm.planner.sim.trace import FIELDS as TRACE_FIELDS
from elastic_rm.planner.sim.trace import TraceError, load_trace
from elastic_rm.train.ledger import LedgerError, RangeLedger
from elastic_rm.wire.channel import HEADER, KIND_ACK, KIND_BYE, KIND_HELLO, KIND_STEPS, MAGIC, STEPS, VERSION
from elastic_rm.wire.metrics import MalformedMetricsError, parse_record
from elastic_rm.wire.records import (
    AckRecord,
    ClosedRecord,
    DemandRecord,
    LedgerRecord,
    NodeRecord,
    RecordError,
    RoundRecord,
)

pytestmark = pytest.mark.timeout(600)  # a hang fails here, not in the CI's global timeout

KEY = "/elastic-rm/run-x/hostile-key"
FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=25,
)


def objects(field_names: list[str], valid: dict | None = None) -> st.SearchStrategy[dict]:
    """JSON objects over the parser's own field names (so the parser gets past its first checks), each
    value drawn from anything JSON, sometimes from a valid record with a few fields replaced."""
    garbage = st.dictionaries(st.sampled_from(field_names), json_values, max_size=len(field_names))
    out = garbage.map(lambda d: {"v": 1, **d} if "v" in field_names and "v" not in d else d)
    if valid is not None:
        out = out | garbage.map(lambda d: {**valid, **d})
    return out


def raw_bytes() -> st.SearchStrategy[bytes]:
    return st.binary(max_size=300) | st.text(max_size=100).map(str.encode)


PATHOLOGICAL = [
    b"",
    b"\xff\xfe\x00",
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError inside json
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b"9" * 10_000,  # longer than Python's int-from-string limit
    b'{"v": 1, "x": ' + b"9" * 10_000 + b"}",
    b"NaN",
    b'{"v": NaN}',
    b'{"v": 1e999}',
    b"null",
    b"[]",
    b'"text"',
]


def expect(
    call: Callable[[], object], error: type[BaseException] | tuple[type[BaseException], ...], source: str
) -> str:
    """Run a parse: success, or ``error`` naming ``source``. Anything else fails the test."""
    try:
        call()
    except error as exc:
        assert source in str(exc), f"error does not name its source {source!r}: {exc}"
        return "error"
    return "ok"


# -- rendezvous records (etcd) --------------------------------------------------------------------------

RDZV = [
    (
        NodeRecord.parse,
        [
            "v",
            "node",
            "host",
            "addr",
            "pid",
            "nproc",
            "state",
            "round",
            "cpu_count",
            "mem_total_bytes",
            "gpu_count",
            "master_port",
        ],
    ),
    (
        RoundRecord.parse,
        [
            "v",
            "round",
            "members",
            "standby",
            "reason",
            "leader",
            "sealed",
            "predicted_gain",
            "confidence",
            "master",
            "time",
            "extra",
        ],
    ),
    (AckRecord.parse, ["v", "node", "master"]),
    (ClosedRecord.parse, ["v", "by", "time"]),
    (DemandRecord.parse, ["v", "target_nodes", "reason", "leader", "round", "time"]),
    (LedgerRecord.parse, ["v", "step", "node", "time", "epoch", "samples_done", "epoch_samples", "ledger"]),
]
VALID_DEMAND = {"v": 1, "target_nodes": 3, "reason": "gain", "leader": "a", "round": 2, "time": 1.0}


@pytest.mark.parametrize("parse,names", RDZV, ids=lambda p: getattr(p, "__qualname__", ""))
def test_rendezvous_records(parse, names):
    @FUZZ
    @given(objects(names, VALID_DEMAND if parse is DemandRecord.parse else None) | raw_bytes())
    def run(value):
        raw = value if isinstance(value, bytes) else json.dumps(value).encode()
        expect(lambda: parse(KEY, raw), RecordError, KEY)

    run()
    for raw in PATHOLOGICAL:
        expect(lambda raw=raw: parse(KEY, raw), RecordError, KEY)


def test_demand_record_round_trip_and_rejects():
    d = DemandRecord(target_nodes=4, reason="predicted gain 12%", leader="n0", round=3, time=5.0)
    assert DemandRecord.parse(KEY, d.to_json()) == d
    for bad in (
        {**VALID_DEMAND, "target_nodes": -1},
        {**VALID_DEMAND, "target_nodes": True},
        {**VALID_DEMAND, "target_nodes": 2.5},
        {k: v for k, v in VALID_DEMAND.items() if k != "target_nodes"},
        {**VALID_DEMAND, "v": 2},
    ):
        with pytest.raises(RecordError, match=KEY):
            DemandRecord.parse(KEY, json.dumps(bad).encode())


# -- agent metrics records (etcd metrics/<node>) ------------------------------------------------------------

METRIC_FIELDS = ["v", "node", "t", "cpu", "mem", "workers", "gpus", "steps"]


@FUZZ
@given(objects(METRIC_FIELDS) | raw_bytes())
def test_metrics_records(value):
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    expect(lambda: parse_record(raw, KEY), MalformedMetricsError, KEY)


def test_metrics_records_pathological():
    for raw in PATHOLOGICAL:
        expect(lambda raw=raw: parse_record(raw, KEY), MalformedMetricsError, KEY)


# -- events (etcd events/ and the event-log file) ------------------------------------------------------------

EVENT_FIELDS = ["v", "time", "run", "node", "kind", "message", "data", "seq"]
VALID_EVENT = {"v": 1, "time": 1.0, "run": "r", "node": "n", "kind": "round", "message": "m", "data": {}}


@FUZZ
@given(objects(EVENT_FIELDS, VALID_EVENT) | raw_bytes())
def test_events(value):
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    expect(lambda: Event.parse(KEY, raw), EventError, KEY)


def test_events_pathological():
    for raw in PATHOLOGICAL:
        expect(lambda raw=raw: Event.parse(KEY, raw), EventError, KEY)


# -- history records (etcd history/<signature>/<run>) --------------------------------------------------------

HISTORY_FIELDS = [
    "v",
    "signature",
    "run_id",
    "status",
    "finished_at",
    "world_size",
    "capacity",
    "throughput",
    "cpu_per_node_used",
    "mem_per_node_peak_bytes",
    "mem_growth_bytes_per_s",
    "coef",
    "duration_s",
]


@FUZZ
@given(objects(HISTORY_FIELDS) | json_values)
def test_history_records(value):
    expect(lambda: parse_history(value, KEY), HistoryError, KEY)


# -- job descriptions (--rdzv-conf job_file, erm plan) -------------------------------------------------------

JOB_FIELDS = [
    "name",
    "tables",
    "request",
    "global_batch",
    "dense_params",
    "bandwidth",
    "optimizer_state_factor",
    "min_nodes",
    "max_nodes",
]
tables = st.lists(
    st.dictionaries(st.sampled_from(["rows", "dim", "name"]), json_values, max_size=3), max_size=3
)
requests = st.dictionaries(
    st.sampled_from(["nodes", "cpu_per_node", "mem_per_node_bytes", "gpus_per_node"]), json_values, max_size=4
)


@FUZZ
@given(
    objects(JOB_FIELDS)
    | st.fixed_dictionaries({"tables": tables}, optional={"request": requests | json_values})
    | json_values
)
def test_job_descriptions(value):
    expect(lambda: parse_job(value, where="job.json"), JobSpecError, "job.json")


# -- the checkpoint manifest (a file in node memory, a peer's replica or the durable copy) -------------------

MANIFEST_FIELDS = ["step", "world_size", "nodes", "plan", "plan_digest", "position", "files", "created_unix"]
file_entries = st.dictionaries(
    st.text(min_size=1, max_size=12),
    st.dictionaries(
        st.sampled_from(["xxh3_128", "sha256", "size", "block", "blocks", "node", "rank"]),
        json_values,
        max_size=6,
    )
    | json_values,
    max_size=3,
)
WHERE = "local:n0 step 7"


@FUZZ
@given(
    st.dictionaries(st.sampled_from(MANIFEST_FIELDS), json_values, max_size=8)
    | st.fixed_dictionaries({"step": json_values, "world_size": json_values, "files": file_entries})
)
def test_manifest_with_a_valid_self_checksum(body):
    """A manifest with a correct self-checksum but hostile fields (anyone can compute a checksum): the
    parser rejects it as corrupt, so restore falls back instead of crashing on manifest['files']."""
    data = make_manifest(body)
    try:
        doc = parse_manifest(data, WHERE)
    except CorruptCheckpointError as exc:
        assert WHERE in str(exc)
        return
    # what restore reads from an accepted manifest must be there with the right types
    assert isinstance(doc["step"], int) and isinstance(doc["world_size"], int) and doc["world_size"] >= 1
    assert isinstance(doc["position"], dict)
    for name, entry in doc["files"].items():
        assert "/" not in name and name not in (".", "..")
        assert isinstance(entry_hash(entry)[1], str) and isinstance(entry["size"], int)


@FUZZ
@given(raw_bytes() | json_values.map(lambda v: json.dumps(v).encode()))
def test_manifest_bytes(raw):
    expect(lambda: parse_manifest(raw, WHERE), CorruptCheckpointError, WHERE)


def test_manifest_pathological_and_path_escape():
    for raw in PATHOLOGICAL:
        expect(lambda raw=raw: parse_manifest(raw, WHERE), CorruptCheckpointError, WHERE)
    entry = {"sha256": "0" * 64, "size": 1, "node": "n0", "rank": 0}
    for name in ("../../etc/passwd", "/etc/passwd", "a/b", ".."):
        body = {"step": 1, "world_size": 1, "nodes": ["n0"], "position": {}, "files": {name: entry}}
        with pytest.raises(CorruptCheckpointError, match="file name"):
            parse_manifest(make_manifest(body), WHERE)
    good = {
        "step": 1,
        "world_size": 1,
        "nodes": ["n0"],
        "position": {"step": 1},
        "files": {"__0_0.distcp": entry},
    }
    assert parse_manifest(make_manifest(good), WHERE)["files"]["__0_0.distcp"] == entry


# -- the sample ledger (in the manifest's position and in etcd) ----------------------------------------------

LEDGER_FIELDS = ["v", "num_samples", "range_size", "epoch", "done", "progress"]
VALID_LEDGER = RangeLedger(100, 10).checkpoint_state()


@FUZZ
@given(objects(LEDGER_FIELDS, VALID_LEDGER) | json_values)
def test_ledger_state(value):
    try:
        led = RangeLedger.from_checkpoint(value)
    except LedgerError as exc:
        assert "ledger" in str(exc)
        return
    assert 0 <= len(led.done) <= led.num_ranges  # an accepted ledger is a consistent one
    assert all(0 <= r < led.num_ranges for r in led.done)


def test_ledger_state_in_etcd(etcd, run_id):
    """EtcdLedgerStore.load names its key; what it returns is checked by RangeLedger.from_checkpoint."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.train.ledger_etcd import EtcdLedgerStore

    key = f"/elastic-rm/{run_id}/ledger"
    with EtcdClient(etcd.endpoint) as c:
        store = EtcdLedgerStore(c, key)
        for raw in [*PATHOLOGICAL, b'{"v": 1, "num_samples": "x"}', b'{"v": 1}']:
            c.put(key, raw)
            try:
                RangeLedger.from_checkpoint(store.load())  # type: ignore[arg-type]
            except LedgerError as exc:
                assert key in str(exc) or "ledger" in str(exc)


# -- trace CSV (erm simulate) --------------------------------------------------------------------------------

csv_cells = st.text(
    alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), max_size=12
) | st.sampled_from(["1", "0", "-1", "nan", "inf", "1e999", "", "0.5", "x"])


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    st.lists(st.lists(csv_cells, min_size=0, max_size=len(TRACE_FIELDS) + 2), max_size=4),
    st.booleans(),
    st.binary(max_size=40),
)
def test_trace_csv(tmp_path_factory, rows, header, junk):
    path = tmp_path_factory.mktemp("trace") / "trace.csv"
    lines = ([",".join(TRACE_FIELDS)] if header else []) + [",".join(r) for r in rows]
    path.write_bytes("\n".join(lines).encode() + (junk if not header else b""))
    expect(lambda: load_trace(str(path)), TraceError, str(path))


# -- the worker channel's struct datagrams (a unix socket any local process can write) -----------------------


def header(kind: int, magic: int = MAGIC, version: int = VERSION) -> bytes:
    return HEADER.pack(magic, version, kind, 4242, 0, 0)


datagrams = (
    st.binary(max_size=200)
    | st.builds(
        lambda k, b: header(k) + b,
        st.sampled_from([KIND_HELLO, KIND_STEPS, KIND_ACK, KIND_BYE, 0, 9]),
        st.binary(max_size=120),
    )
    | st.builds(
        lambda n, extra, durs: (
            header(KIND_STEPS) + STEPS.pack(1, 8, n) + struct.pack(f"<{len(durs)}d", *durs) + extra
        ),
        st.integers(0, 2**32 - 1),
        st.binary(max_size=9),
        st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=6),
    )
)


def test_worker_channel_datagrams(tmp_path):
    ch = AgentChannel(directory=str(tmp_path / "agent"), window_s=5.0)
    try:

        @FUZZ
        @given(datagrams)
        def run(data):
            before = ch.malformed_total
            ch.handle_datagram(data)  # never raises
            assert ch.malformed_total in (before, before + 1)

        run()
        ch.handle_datagram(header(KIND_STEPS) + STEPS.pack(1, 8, 2**32 - 1))  # claims 4 G durations
        assert ch.malformed_total >= 1
        s = ch.summary()  # the summary of whatever was accepted stays computable
        if s is not None:
            assert s.steps >= 0 and not math.isnan(float(s.steps))
    finally:
        ch.close()
