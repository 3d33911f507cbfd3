"""A node whose GPUs do not report utilisation (MIG slices: ``util`` null in its metrics record) is not
a straggler: the planner compared it as a GPU at 0% and replaced it at the same step time as the rest."""

from __future__ import annotations

import json
from dataclasses import replace

from elastic_rm.planner.interface import Decision
from elastic_rm.planner.policy import PlannerPolicy
from elastic_rm.wire.metrics import parse_record, to_node_metrics

from .helpers import feed, running
from .test_policy import CFG, settled


def _record(metrics, node: str, utils: list[float | None]) -> dict:
    gpu = {
        "mem_used_bytes": 1,
        "mem_total_bytes": 2,
        "temp_c": None,
        "throttled": False,
        "throttle_reasons": [],
    }
    return {
        "v": 1,
        "node": node,
        "t": 1.0,
        "cpu": {"util_mean": 0.3, "util_max": 0.3, "util_last": 0.3},
        "mem": {
            "used_bytes": metrics.mem_used_bytes,
            "available_bytes": metrics.mem_available_bytes,
            "total_bytes": metrics.mem_total_bytes,
        },
        "workers": [],
        "gpus": [gpu | {"index": i, "util": u} for i, u in enumerate(utils)],
        "steps": {
            "p50_s": metrics.steps.p50_s,
            "p90_s": metrics.steps.p90_s,
            "samples_per_s": metrics.steps.samples_per_s,
            "steps": metrics.steps.steps,
            "age_s": 0.1,
        },
    }


def through_the_wire(snap, who: str, utils: list[float | None]):
    """``who``'s metrics as the leader gets them: its agent's record, parsed."""
    nodes = []
    for n in snap.nodes:
        if n.node_id == who:
            raw = json.dumps(_record(n.metrics, who, utils))
            n = replace(n, metrics=to_node_metrics(parse_record(raw, f"metrics/{who}")))
        nodes.append(n)
    return replace(snap, nodes=tuple(nodes))


def test_a_node_whose_gpus_do_not_report_utilisation_is_not_flagged():
    p = PlannerPolicy(CFG)
    members = ["a", "b", "c", "d"]
    st = settled(p, members, extra=["e"], t0=100, max_nodes=4)
    snaps = [
        through_the_wire(running(t, members, extra=["e"], max_nodes=4), "d", [None, None])
        for t in range(100, 200, 10)
    ]
    answers, st = feed(p, snaps, st)
    assert not any(isinstance(a, Decision) for a in answers), answers
    assert "d" not in st.flagged


def test_known_gpus_of_a_node_still_count_and_an_idle_one_is_still_slow():
    """One GPU unknown, one idle: the node's known GPU is what it is compared by (an idle GPU is slow)."""
    p = PlannerPolicy(CFG)
    members = ["a", "b", "c", "d"]
    st = settled(p, members, extra=["e"], t0=100, max_nodes=4)
    snaps = [
        through_the_wire(running(t, members, extra=["e"], max_nodes=4), "d", [None, 0.0])
        for t in range(100, 130, 10)
    ]
    answers, st = feed(p, snaps, st)
    assert isinstance(answers[-1], Decision) and "straggler" in answers[-1].reason
