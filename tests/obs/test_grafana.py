"""The example Grafana dashboard queries only metrics that an agent really exports."""

from __future__ import annotations

import json
import os
import re

from elastic_rm.obs.metrics import METRIC_NAMES, AgentMetrics
from tests.conftest import REPO

DASHBOARD = os.path.join(REPO, "examples", "grafana", "elastic-rm-dashboard.json")
RECORD = {
    "v": 1,
    "node": "n1",
    "t": 1764495600.1,
    "cpu": {"util_mean": 0.41, "util_max": 0.52, "util_last": 0.40},
    "mem": {"used_bytes": 3, "available_bytes": 2, "total_bytes": 5},
    "workers": [{"pid": 123, "rss_bytes": 1024, "cpu_util": 0.98}],
    "gpus": [
        {
            "index": 0,
            "util": 0.9,
            "mem_used_bytes": 5,
            "mem_total_bytes": 6,
            "temp_c": 61.0,
            "throttled": True,
            "throttle_reasons": ["sw_power_cap"],
        }
    ],
    "steps": {"p50_s": 0.011, "p90_s": 0.013, "samples_per_s": 5800.0, "steps": 2700, "age_s": 0.2},
}


def exported_names() -> set[str]:
    """Sample names in an agent's /metrics with every series present (a GPU, workers, steps)."""
    metrics = AgentMetrics("n1")
    metrics.update(RECORD)
    metrics.add_steps(10)
    metrics.set_round(3)
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def expressions(node) -> list[str]:
    if isinstance(node, dict):
        own = [node["expr"]] if "expr" in node else []
        return own + [e for v in node.values() for e in expressions(v)]
    if isinstance(node, list):
        return [e for v in node for e in expressions(v)]
    return []


def test_every_query_uses_exported_metrics_and_every_metric_is_charted():
    exported = exported_names()
    assert set(METRIC_NAMES) <= exported  # the documented list is what the registry serves
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    exprs = expressions(dashboard["panels"])
    assert len(exprs) >= 10
    used = set()
    for expr in exprs:
        names = set(re.findall(r"\belastic_rm_[a-z0-9_]+", expr))
        assert names, f"query without an elastic-rm metric: {expr}"
        assert names <= exported, f"{expr}: unknown metric(s) {sorted(names - exported)}"
        used |= names
    assert used == set(METRIC_NAMES), f"metrics not charted: {sorted(set(METRIC_NAMES) - used)}"
    variable = dashboard["templating"]["list"][1]["definition"]
    assert set(re.findall(r"\belastic_rm_[a-z0-9_]+", variable)) <= exported
