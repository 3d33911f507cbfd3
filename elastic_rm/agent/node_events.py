"""The events an agent writes about its node from what it observes: new flash checkpoints in node memory,
and periodic resource/throughput samples. Apart from the agent so that the agent stays its life cycle."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.manifest import MANIFEST, committed_steps, step_dirname
from ..obs.events import EventLog
from ..wire.records import RoundRecord


def emit_new_checkpoints(events: EventLog, node_dir: Path, last: int) -> int:
    """A "checkpoint" event for the newest flash checkpoint this node's workers committed in its memory
    after step ``last`` (a step directory with its manifest): seen from the agent, so workers need no
    extra channel. Returns the newest committed step (``last`` when there is none newer)."""
    committed = [
        s for s in committed_steps(node_dir) if s > last and (node_dir / step_dirname(s) / MANIFEST).is_file()
    ]
    if not committed:
        return last
    events.emit(
        "checkpoint",
        f"flash checkpoint of step {committed[-1]} committed in node memory",
        step=committed[-1],
        directory=str(node_dir),
    )
    return committed[-1]


def emit_sample(events: EventLog, node_id: str, record: dict[str, Any], joined: RoundRecord) -> None:
    """A compact "sample" event: what ``erm report`` plots per node and ``erm status`` measures gains
    with (etcd keeps only each node's latest ``metrics/<node>``)."""
    steps = record.get("steps") or {}
    members = list(joined.members)
    rate = steps.get("samples_per_s")
    events.emit(
        "sample",
        f"round {joined.round}: " + (f"{rate:,.0f} samples/s" if rate is not None else "no steps"),
        round=joined.round,
        world=len(members),
        rank=members.index(node_id) if node_id in members else None,
        cpu=round(record["cpu"]["util_mean"], 4),
        mem_used_bytes=record["mem"]["used_bytes"],
        mem_total_bytes=record["mem"]["total_bytes"],
        gpu_util=[None if g["util"] is None else round(g["util"], 4) for g in record["gpus"]],
        samples_per_s=rate,
        step_p50_s=steps.get("p50_s"),
    )
