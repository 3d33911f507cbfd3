"""Downtime and steps trained again per round, from the agents' "restore" events (elastic_rm.agent.restores):
what ``erm status`` and ``erm report`` show next to each decision."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .events import Event


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def round_restores(events: Iterable[Event]) -> dict[int, dict[str, Any]]:
    """Per round: the step restored, the worlds before and after, the downtime (the slowest node's: the
    job trains again once every node does) and the steps trained again (the most any node lost), and the
    nodes that reported. Rounds whose events lack a number show None for it."""
    out: dict[int, dict[str, Any]] = {}
    for e in events:
        r = e.data.get("round")
        if e.kind != "restore" or not isinstance(r, int) or isinstance(r, bool):
            continue
        row = out.setdefault(
            r,
            {
                "restored_step": None,
                "world_before": None,
                "world_after": None,
                "downtime_s": None,
                "redone_steps": None,
                "nodes": [],
            },
        )
        for key, field in (
            ("restored_step", "step"),
            ("world_before", "world_before"),
            ("world_after", "world_after"),
        ):
            if isinstance(e.data.get(field), int):
                row[key] = e.data[field]
        for key in ("downtime_s", "redone_steps"):
            value = _num(e.data.get(key))
            if value is not None:
                row[key] = value if row[key] is None else max(row[key], value)
        if isinstance(row["redone_steps"], float):
            row["redone_steps"] = int(row["redone_steps"])
        row["nodes"] = sorted({*row["nodes"], e.node})
    return out


def with_restores(rows: list[dict[str, Any]], restores: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Decision rows (elastic_rm.obs.status.decision_rows) with their round's restore figures added."""
    empty = {"restored_step": None, "downtime_s": None, "redone_steps": None}
    return [
        {**row, **empty, **{k: v for k, v in restores.get(row["round"], {}).items() if k in empty}}
        for row in rows
    ]
