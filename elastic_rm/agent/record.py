"""This node's ``metrics/<node>`` record, built from the monitor's and the channel's summaries.

The format (and its parser) lives in :mod:`elastic_rm.wire.metrics`; this is the agent's half.
"""

from __future__ import annotations

import time
from typing import Any

from ..wire.metrics import RECORD_VERSION
from .channel import StepSummary
from .monitor import ResourceSummary


def build_record(
    node: str,
    resources: ResourceSummary,
    steps: StepSummary | None,
    t: float | None = None,
    spares: tuple[int, int] | None = None,
) -> dict[str, Any]:
    """The JSON-ready record from the monitor's and the channel's summaries; ``spares``: (count, RSS
    bytes) of the waiting spare workers, None with spares off."""
    record = {
        "v": RECORD_VERSION,
        "node": node,
        "t": time.time() if t is None else t,
        "cpu": {
            "util_mean": _unit(resources.cpu_util_mean),
            "util_max": _unit(resources.cpu_util_max),
            "util_last": _unit(resources.cpu_util_last),
        },
        "mem": {
            "used_bytes": resources.mem_used_bytes,
            "available_bytes": resources.mem_available_bytes,
            "total_bytes": resources.mem_total_bytes,
            "node_bytes": resources.mem_node_bytes,
        },
        "workers": [
            {"pid": w.pid, "rss_bytes": w.rss_bytes, "cpu_util": w.cpu_util} for w in resources.workers
        ],
        "gpus": [
            {
                "index": g.index,
                "util": None if g.util is None else _unit(g.util),
                "mem_used_bytes": g.mem_used_bytes,
                "mem_total_bytes": g.mem_total_bytes,
                "temp_c": g.temp_c,
                "throttled": g.throttled,
                "throttle_reasons": list(g.throttle_reasons),
            }
            for g in resources.gpus
        ],
        "steps": None
        if steps is None
        else {
            "p50_s": steps.p50_s,
            "p90_s": steps.p90_s,
            "busy_p50_s": steps.busy_p50_s,
            "samples_per_s": steps.samples_per_s,
            "steps": steps.steps,
            "age_s": steps.age_s,
        },
    }
    if spares is not None:
        record["spares"] = {"count": spares[0], "rss_bytes": spares[1]}
    return record


def _unit(x: float) -> float:
    """Fractions of the node are clamped to 0..1: the parser rejects anything outside."""
    return min(max(float(x), 0.0), 1.0)
