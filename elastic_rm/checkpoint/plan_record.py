"""A sharding plan as JSON: what a checkpoint records of the plan that wrote it (its manifest's ``plan``
and ``plan_digest``), and what ranks compare to agree on one plan before they train."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torchrec.distributed.types import ShardingPlan


def plan_summary(plan: ShardingPlan) -> dict[str, Any]:
    """JSON-able plan: module -> table -> sharding type, kernel and [row_off, col_off, rows, cols, rank]."""
    out: dict[str, Any] = {}
    for module_path, mplan in sorted(plan.plan.items()):
        tables: dict[str, Any] = {}
        for name, ps in sorted(mplan.items()):  # type: ignore[union-attr]
            shards = []
            if ps.sharding_spec is not None:
                for s in ps.sharding_spec.shards:  # type: ignore[union-attr]
                    shards.append([*s.shard_offsets, *s.shard_sizes, s.placement.rank()])
            tables[name] = {"type": ps.sharding_type, "kernel": ps.compute_kernel, "shards": shards}
        out[module_path] = tables
    return out


def plan_digest(plan: ShardingPlan) -> str:
    return hashlib.sha256(json.dumps(plan_summary(plan), sort_keys=True).encode()).hexdigest()
