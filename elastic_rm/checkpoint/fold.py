"""Compaction of a differential chain without a full pause: the checkpointer's snapshot buffers follow
the chain, so that a new base can be written from them in the background.

A full save leaves one copy of each rank's state in the snapshot buffers (elastic_rm/checkpoint/
snapshot.py). After each delta is committed, its rows are written into those buffers; a delta save also
copies the dense tensors into them on every rank (a delta file holds them from rank 0 only). The buffers
then hold the state of the chain's newest step. When a chain's deltas pass the bound, the save takes the
touched rows like a delta (the step pause of a delta), writes them into the buffers off the step loop and
saves the buffers with DCP as a full step: the same files a full save of that step writes.

Why the checkpointer's background thread and not the node's checkpoint server: the buffers already hold
the state in the layout DCP writes, so folding there costs no second copy and no reading back of the
base; the server runs in the agent, which loads neither torch nor DCP. The peer's replica and the
durable copy receive the new base like any full step: a fold on the peer would need the state (or the
old base's DCP files read back into tensors) on a process that has neither.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from elastic_rm.checkpoint.chain import DeltaTake, apply_own_delta

# A fold's pause takes the touched rows by index, which costs more per byte than the full snapshot's plain
# copy into its buffers; past this share of the tracked tables' rows, the full snapshot pauses less, and it
# writes the same base.
FOLD_MAX_TOUCHED = 0.04


def fold_by_rows(touched: dict[str, torch.Tensor], tables: dict[str, int]) -> bool:
    """Should a fold take the touched rows (few of them), rather than snapshot every tensor?"""
    total = sum(tables.values())
    return total > 0 and sum(len(touched.get(t, ())) for t in tables) <= FOLD_MAX_TOUCHED * total


@torch.no_grad()
def copy_dense(buffers: Any, live: Any) -> int:
    """Copy every plain tensor of `live` (dense layers, data-parallel tables, optimizer scalars) into
    the same place of `buffers` (a snapshot of the same state dict); returns the bytes copied."""
    if isinstance(live, dict):
        return sum(copy_dense(buffers[k], v) for k, v in live.items() if k in buffers)
    if isinstance(live, torch.Tensor) and not isinstance(live, ShardedTensor):
        buffers.copy_(live.detach())
        return live.numel() * live.element_size()
    return 0


def roll_forward(buffers: dict, take: DeltaTake) -> int:
    """Write a delta's rows (and whole pieces) into the snapshot buffers; returns elements written."""
    return apply_own_delta(buffers, take.pieces)
