"""metrics/<node> record: round trip from real summaries, planner conversion, strict parsing."""

from __future__ import annotations

import copy
import json
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_rm.agent.channel import StepSummary
from elastic_rm.agent.gpu import GpuSample
from elastic_rm.agent.monitor import ResourceMonitor
from elastic_rm.agent.record import build_record
from elastic_rm.planner.interface import NodeMetrics, StepStats
from elastic_rm.wire.metrics import MalformedMetricsError, encode_record, parse_record, to_node_metrics


class _OneGpu:
    def sample(self):
        return [GpuSample(0, 0.5, 3 << 30, 80 << 30, 60.0, ("sw_power_cap",)), GpuSample(1, None, 1, 2, None)]

    def close(self):
        pass


@pytest.fixture(scope="module")
def record() -> dict:
    mon = ResourceMonitor(interval_s=1.0, gpu_probe=_OneGpu())
    import os

    mon.set_pids([os.getpid()])
    mon.sample_once()
    time.sleep(0.05)
    mon.sample_once()
    resources = mon.summary()
    assert resources is not None
    steps = StepSummary(
        p50_s=0.01, p90_s=0.012, busy_p50_s=0.004, samples_per_s=3200.0, steps=250, age_s=0.1, workers=2
    )
    return build_record("node-a", resources, steps)


def test_round_trip_and_planner_view(record):
    raw = encode_record(record)
    assert len(raw) < 2048  # small enough to rewrite every second
    rec = parse_record(raw, key="/elastic-rm/r1/metrics/node-a")
    assert rec.node == "node-a" and rec.workers[0].rss_bytes > 0
    assert rec.gpus[1].util is None and rec.gpus[0].throttle_reasons == ("sw_power_cap",)
    nm = to_node_metrics(rec)
    assert isinstance(nm, NodeMetrics)
    assert nm.cpu_util == record["cpu"]["util_mean"]
    assert nm.mem_total_bytes == record["mem"]["total_bytes"]
    assert nm.gpu_util == (0.5, 0.0) and nm.gpu_mem_used_bytes == (3 << 30, 1) and nm.gpu_throttled
    assert nm.steps == StepStats(p50_s=0.01, p90_s=0.012, samples_per_s=3200.0, steps=250, busy_p50_s=0.004)
    older = copy.deepcopy(record)
    del older["steps"]["busy_p50_s"]  # an agent before busy times: accepted, busy unknown
    assert to_node_metrics(parse_record(older)).steps.busy_p50_s is None
    no_steps = dict(record, steps=None)
    assert to_node_metrics(parse_record(no_steps)).steps is None
    assert parse_record(dict(record, extra={"future": 1})).node == "node-a"  # unknown keys are ignored


def _mutate(record: dict, path: str, value) -> dict:
    doc = copy.deepcopy(record)
    *parents, last = path.split(".")
    target = doc
    for p in parents:
        target = target[int(p)] if p.isdigit() else target[p]
    key = int(last) if isinstance(target, list) else last
    if value is KeyError:
        del target[key]
    else:
        target[key] = value
    return doc


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("v", 2, "'v'"),
        ("node", "", "'node'"),
        ("t", "yesterday", "'t'"),
        ("cpu", KeyError, "'cpu'"),
        ("cpu.util_mean", 1.5, "'cpu.util_mean'"),
        ("cpu.util_max", True, "'cpu.util_max'"),
        ("mem.used_bytes", -1, "'mem.used_bytes'"),
        ("mem.total_bytes", 1.5, "'mem.total_bytes'"),
        ("workers", {}, "'workers'"),
        ("workers.0.pid", "12", "'workers[0].pid'"),
        ("gpus.0.throttled", "no", "'gpus[0].throttled'"),
        ("gpus.0.throttle_reasons", [1], "'gpus[0].throttle_reasons'"),
        ("gpus.1.util", 2.0, "'gpus[1].util'"),
        ("steps", KeyError, "'steps'"),
        ("steps", [], "'steps'"),
        ("steps.p90_s", None, "'steps.p90_s'"),
        ("steps.steps", 2.5, "'steps.steps'"),
    ],
)
def test_malformed_field_is_a_clear_error(record, path, value, field):
    with pytest.raises(MalformedMetricsError) as err:
        parse_record(encode_record(_mutate(record, path, value)), key="/p/r/metrics/node-a")
    msg = str(err.value)
    assert "'/p/r/metrics/node-a'" in msg and field in msg, msg


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"v": 1, "node": "a", "t": NaN}', "not valid JSON"),
    ],
)
def test_undecodable_record_is_a_clear_error(raw, expect):
    with pytest.raises(MalformedMetricsError, match=expect) as err:
        parse_record(raw, key="metrics/x")
    assert "'metrics/x'" in str(err.value)


def test_encode_refuses_nan(record):
    with pytest.raises(ValueError):
        encode_record(_mutate(record, "t", float("nan")))
    assert json.loads(encode_record(record)) == record


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=20,
)
FIELDS = [
    "v",
    "node",
    "t",
    "cpu",
    "cpu.util_mean",
    "mem",
    "mem.available_bytes",
    "workers",
    "workers.0",
    "workers.0.cpu_util",
    "gpus",
    "gpus.0",
    "gpus.0.index",
    "gpus.0.util",
    "gpus.0.temp_c",
    "gpus.0.throttle_reasons",
    "steps",
    "steps.age_s",
    "steps.samples_per_s",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(FIELDS), value=json_values | st.just(KeyError))
def test_any_corruption_is_an_error_or_a_valid_record_never_a_crash(record, path, value):
    doc = _mutate(record, path, value)
    try:
        raw = encode_record(doc)
    except ValueError:
        return  # not representable as JSON (inf): nothing an agent could publish
    try:
        to_node_metrics(parse_record(raw, key="k"))
    except MalformedMetricsError as err:
        assert "'k'" in str(err)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | json_values.map(lambda v: json.dumps(v).encode()))
def test_arbitrary_bytes_never_crash_the_parser(raw):
    with pytest.raises(MalformedMetricsError):
        parse_record(raw, key="k")


def test_huge_numbers_and_deep_nesting_are_errors():
    with pytest.raises(MalformedMetricsError, match="'t'"):
        parse_record(b'{"v": 1, "node": "a", "t": 1' + b"0" * 400 + b"}", key="k")
    with pytest.raises(MalformedMetricsError, match="not valid JSON"):
        parse_record(b"[" * 100_000, key="k")


def test_spares_round_trip_to_the_status_and_prometheus(record):
    from elastic_rm.obs.metrics import AgentMetrics

    with_spares = copy.deepcopy(record)
    with_spares["spares"] = {"count": 2, "rss_bytes": 123 << 20}
    rec = parse_record(encode_record(with_spares))
    assert (rec.spares, rec.spares_rss_bytes) == (2, 123 << 20)
    assert parse_record(encode_record(record)).spares is None  # spares off (or an older agent)
    bad = copy.deepcopy(with_spares)
    bad["spares"]["rss_bytes"] = "lots"
    with pytest.raises(MalformedMetricsError, match=r"spares\.rss_bytes"):
        parse_record(bad)
    metrics = AgentMetrics("node-a")
    metrics.update(with_spares)
    text = metrics.exposition().decode()
    assert 'elastic_rm_spare_workers{node="node-a"} 2.0' in text
    assert 'elastic_rm_spare_resident_memory_bytes{node="node-a"} 1.28974848e+08' in text


def test_erm_status_shows_each_nodes_spares(record):
    from rich.console import Console

    from elastic_rm.etcd.types import KeyValue
    from elastic_rm.obs.status import status_from_kvs
    from elastic_rm.wire.keyspace import Keyspace
    from elastic_rm.wire.records import NodeRecord, NodeState, dumps
    from launcher.commands.status import render

    keys = Keyspace("/elastic-rm", "r1")
    node = NodeRecord("node-a", "h", "127.0.0.1", 1, 1, NodeState.STANDBY)
    with_spares = {**copy.deepcopy(record), "spares": {"count": 1, "rss_bytes": 3 << 28}}
    kvs = [
        KeyValue(keys.node("node-a"), dumps(node), 1, 1, 1, 0),
        KeyValue(keys.metric("node-a"), encode_record(with_spares), 1, 1, 1, 0),
    ]
    s = status_from_kvs(keys, kvs, revision=1)
    assert [(n["node"], n["spares"], n["spares_rss_bytes"]) for n in s["standby"]] == [("node-a", 1, 3 << 28)]
    console = Console(width=80, record=True)
    console.print(render(s))
    assert "warm spares: node-a 1 (0.75G)" in console.export_text()
