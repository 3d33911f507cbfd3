"""Per-agent HTTP endpoint: /healthz, Prometheus /metrics, port handling."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from elastic_rm.agent.http import AgentHttpServer, EndpointError
from elastic_rm.obs.metrics import METRIC_NAMES, AgentMetrics

RECORD = {
    "v": 1,
    "node": "n1",
    "t": 1764495600.0,
    "cpu": {"util_mean": 0.25, "util_max": 0.5, "util_last": 0.3},
    "mem": {"used_bytes": 3 << 30, "available_bytes": 20 << 30, "total_bytes": 24 << 30},
    "workers": [{"pid": 4242, "rss_bytes": 1 << 30, "cpu_util": 0.97}],
    "gpus": [
        {
            "index": 0,
            "util": 0.8,
            "mem_used_bytes": 5,
            "mem_total_bytes": 10,
            "temp_c": 61.0,
            "throttled": True,
            "throttle_reasons": ["sw_power_cap"],
        },
    ],
    "steps": {"p50_s": 0.011, "p90_s": 0.015, "samples_per_s": 2900.0, "steps": 300, "age_s": 0.2},
}


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_healthz_and_metrics(free_port):
    m = AgentMetrics("n1")
    m.update(RECORD)
    m.add_steps(300)
    m.set_round(7)
    m.set_state("active")
    with AgentHttpServer(m, free_port) as srv:
        assert srv.url == f"http://127.0.0.1:{free_port}"
        code, ctype, body = get(srv.url + "/healthz")
        assert code == 200 and ctype == "application/json"
        assert json.loads(body) == {"status": "ok", "node": "n1", "state": "active"}
        code, ctype, body = get(srv.url + "/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        got = samples(body)
        n = ("node", "n1")
        assert got[("elastic_rm_node_cpu_usage_ratio", (n, ("stat", "max")))] == 0.5
        assert got[("elastic_rm_node_memory_available_bytes", (n,))] == 20 << 30
        assert got[("elastic_rm_worker_cpu_usage_cores", (n, ("pid", "4242")))] == 0.97
        assert got[("elastic_rm_gpu_throttle_reason", (("gpu", "0"), n, ("reason", "sw_power_cap")))] == 1
        assert got[("elastic_rm_step_duration_seconds", (n, ("quantile", "0.9")))] == 0.015
        assert got[("elastic_rm_step_throughput_samples_per_second", (n,))] == 2900.0
        assert got[("elastic_rm_steps_reported_total", (n,))] == 300
        assert got[("elastic_rm_round", (n,))] == 7
        assert got[("elastic_rm_agent_state", (n, ("state", "active")))] == 1
        assert got[("elastic_rm_agent_state", (n, ("state", "joining")))] == 0
        assert {name for name, _ in got} >= set(METRIC_NAMES)
        # step times age out: the series disappear instead of freezing at stale values
        m.update(dict(RECORD, steps=None))
        assert "elastic_rm_step_duration_seconds{" not in get(srv.url + "/metrics")[2]
        assert get(srv.url + "/nope")[0] == 404
    with pytest.raises(OSError):  # stopped: nothing listens any more
        socket.create_connection(("127.0.0.1", free_port), timeout=1).close()


def test_unhealthy_is_503(free_port):
    srv = AgentHttpServer(
        AgentMetrics("n1"), free_port, health=lambda: (False, {"status": "rendezvous lost"})
    )
    with srv:
        code, _, body = get(srv.url + "/healthz")
    assert code == 503 and json.loads(body) == {"status": "rendezvous lost"}


def test_port_in_use_is_a_clear_error(free_port):
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port))
        s.listen()
        with pytest.raises(EndpointError, match=f"port {free_port} on 127.0.0.1 is already in use"):
            AgentHttpServer(AgentMetrics("n1"), free_port).start()
    srv = AgentHttpServer(AgentMetrics("n1"), free_port).start()  # the failed start left nothing bound
    srv.stop()


@pytest.mark.parametrize("port", [None, 0])
def test_port_zero_or_none_is_off(port):
    srv = AgentHttpServer(AgentMetrics("n1"), port).start()
    assert not srv.enabled and srv.url is None
    srv.stop()


@pytest.mark.parametrize("port", [-1, 70000, True, "80"])
def test_bad_port_is_rejected(port):
    with pytest.raises(ValueError, match="metrics port"):
        AgentHttpServer(AgentMetrics("n1"), port)
