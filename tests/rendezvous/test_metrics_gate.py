"""Metrics records are written on change beyond a band or as a heartbeat (wire/metrics_gate.py), through a
real handler and etcd: a steady node does not write every second, a change or a new round does."""

from __future__ import annotations

import copy
import json
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.rendezvous.registration import create_handler
from elastic_rm.wire.metrics_gate import PublishGate, changed

RECORD = {
    "v": 1,
    "node": "x",
    "t": 0.0,
    "cpu": {"util_mean": 0.5, "util_max": 0.6, "util_last": 0.5},
    "mem": {"used_bytes": 2**30, "available_bytes": 2**31, "total_bytes": 2**33},
    "workers": [{"pid": 10, "rss_bytes": 2**29, "cpu_util": 0.9}],
    "gpus": [],
    "steps": {"p50_s": 0.01, "p90_s": 0.012, "samples_per_s": 1000.0, "steps": 50, "age_s": 0.1},
}


def variant(**changes):
    """RECORD with dotted paths replaced: variant(**{"steps.p50_s": 0.02})."""
    r = copy.deepcopy(RECORD)
    for path, value in changes.items():
        *parents, last = path.split(".")
        target = r
        for p in parents:
            target = target[int(p)] if isinstance(target, list) else target[p]
        target[int(last) if isinstance(target, list) else last] = value
    return r


@pytest.mark.parametrize(
    "changes,news",
    [
        ({"t": 99.0, "steps.age_s": 0.9, "steps.steps": 80}, False),  # change on every record by construction
        ({"steps.samples_per_s": 1030.0, "cpu.util_mean": 0.51}, False),  # within 5%
        ({"steps.samples_per_s": 1100.0}, True),
        ({"steps.p50_s": 0.0106}, True),  # small in seconds, 6% relative: news (no absolute floor)
        ({"cpu.util_mean": 0.03}, True),
        ({"workers.0.pid": 11}, True),  # a new worker process
        ({"steps": None}, True),  # steps went
        ({"workers": []}, True),
    ],
)
def test_what_counts_as_a_change(changes, news):
    assert changed(RECORD, variant(**changes)) is news


def test_utilisation_near_zero_does_not_flap():
    assert not changed(variant(**{"cpu.util_mean": 0.001}), variant(**{"cpu.util_mean": 0.004}))


def test_gate_heartbeat_and_reset():
    gate = PublishGate(heartbeat_s=10)
    assert gate.due(RECORD, 0.0)
    gate.published(RECORD, 0.0)
    assert not gate.due(variant(t=5.0), 5.0)
    assert gate.due(variant(t=10.0), 10.0)  # heartbeat
    gate.published(RECORD, 10.0)
    gate.reset()
    assert gate.due(RECORD, 10.5)
    with pytest.raises(ValueError, match="heartbeat_s > 0"):
        PublishGate(heartbeat_s=0)


def test_handler_writes_a_steady_record_once_then_on_change(etcd, run_id):
    params = RendezvousParameters(
        "elastic-rm", etcd.endpoint, run_id, 1, 1, local_addr="127.0.0.1", join_timeout=20
    )
    h = create_handler(params)
    try:
        h.next_rendezvous()
        key = h.settings.keys.metric(h.node_id)
        with EtcdClient(etcd.endpoint) as c:

            def publish_and_read(record):
                h.services.publish_metrics(json.dumps({**record, "node": h.node_id}).encode())
                deadline = time.monotonic() + 5
                kv = c.get(key)
                while (
                    time.monotonic() < deadline
                ):  # put_nowait: wait until etcd has what we sent, if anything
                    time.sleep(0.2)
                    newer = c.get(key)
                    if newer is not None and (kv is None or newer.mod_revision == kv.mod_revision):
                        return newer
                    kv = newer
                return kv

            first = publish_and_read(variant(t=1.0))
            assert first is not None and json.loads(first.value)["t"] == 1.0
            same = publish_and_read(variant(t=2.0, **{"steps.samples_per_s": 1010.0}))
            assert same.mod_revision == first.mod_revision  # within the band: not written
            moved = publish_and_read(variant(t=3.0, **{"steps.samples_per_s": 2000.0}))
            assert moved.mod_revision > first.mod_revision and json.loads(moved.value)["t"] == 3.0
    finally:
        h.release()
