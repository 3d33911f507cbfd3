"""Compaction of a differential chain, on the writer's side: what the checkpointer needs to fold its
chain into its base in place (elastic_rm/checkpoint/inplace.py) without a second base in memory.

The checkpointer's snapshot buffers follow the chain: a full save leaves one copy of each rank's state
in them, and after each committed delta its rows (and the dense tensors, which a delta save copies into
them on every rank) are written into them. So they hold the state of the chain's newest step, and the
new base's checksums are known before the old base is touched: its files are the old base's bytes with
each tensor's raw bytes replaced by the buffers'. A base save records, in its manifest, where each
tensor's raw bytes lie in its DCP file (the layout), after checking that they are the buffers' bytes;
a fold needs that layout, and each dense tensor's delta rows must come from the rank whose file holds
the tensor (`writers_of`), so that every node folds its own files from its own delta files.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import Metadata

from elastic_rm.checkpoint.chain import DeltaTake, apply_own_delta
from elastic_rm.checkpoint.inplace import Item, data_span
from elastic_rm.checkpoint.manifest import entry_of_segments
from elastic_rm.checkpoint.snapshot import local_pieces

Pieces = dict[tuple[str, tuple[int, ...]], torch.Tensor]


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


@torch.no_grad()
def clone_dense(live: Any) -> Any:
    """A copy of every plain tensor of `live`, in its nesting (copy_dense takes it as `live`): a fold's
    pause keeps the dense state here, and it goes into the buffers only after the chain before it was
    folded (the fold's checksums are computed from the buffers)."""
    if isinstance(live, dict):
        return {k: clone_dense(v) for k, v in live.items()}
    if isinstance(live, torch.Tensor) and not isinstance(live, ShardedTensor):
        return live.detach().clone()
    return None


def roll_forward(buffers: dict, take: DeltaTake) -> int:
    """Write a delta's rows (and whole pieces) into the snapshot buffers; returns elements written."""
    return apply_own_delta(buffers, take.pieces)


def buffer_pieces(state: Any, path: tuple[str, ...] = ()) -> Pieces:
    """Every local tensor piece of a state dict by (DCP's flattened key, global offsets)."""
    out: Pieces = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(buffer_pieces(v, (*path, str(k))))
    elif isinstance(state, torch.Tensor):
        for off, t in local_pieces(state):
            out[(".".join(path), tuple(off))] = t
    return out


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def base_layout(md: Metadata, step_dir: Path, rank: int, snap: dict) -> dict[str, list[Item]] | None:
    """Where each tensor of this rank's DCP files of a base lies ([fqn, offsets, sizes, at, nbytes] per
    file), checked against the snapshot `snap` that DCP wrote; None when a tensor is not a plain
    contiguous copy of a buffer (that base then cannot be folded in place)."""
    pieces = buffer_pieces(snap)
    out: dict[str, list[Item]] = {}
    for idx, info in md.storage_data.items():
        if not info.relative_path.startswith(f"__{rank}_"):
            continue
        t = pieces.get((idx.fqn, tuple(idx.offset or ())))
        if t is None or not t.is_contiguous() or info.transform_descriptors:
            return None
        try:
            at, nbytes = data_span(step_dir / info.relative_path, info.offset, info.length)
        except ValueError:
            return None
        raw = _raw(t)
        if nbytes != raw.nbytes:
            return None
        with (
            open(step_dir / info.relative_path, "rb") as f,
            mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m,
        ):
            stored = np.frombuffer(m, dtype=np.uint8, count=nbytes, offset=at)
            same = bool(np.array_equal(stored, raw))
            del stored
        if not same:
            return None
        out.setdefault(info.relative_path, []).append(
            [idx.fqn, list(idx.offset or ()), list(t.shape), at, nbytes]
        )
    return out


def writers_of(manifest: dict[str, Any]) -> dict[str, int]:
    """The rank whose file of the base holds each tensor (by DCP's flattened key)."""
    out: dict[str, int] = {}
    for name, items in (manifest.get("layout") or {}).items():
        for item in items:
            out[item[0]] = int(manifest["files"][name]["rank"])
    return out


def folded_entry(path: Path, items: list[Item], pieces: Pieces, block: int) -> dict[str, Any]:
    """The manifest entry `path` (a base's DCP file) will have once each of its tensors holds the
    buffers' bytes: computed without writing it."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:

            def segments() -> Iterator[memoryview]:
                pos = 0
                for fqn, offsets, _, at, nbytes in sorted(items, key=lambda it: it[3]):
                    yield view[pos:at]
                    raw = _raw(pieces[(fqn, tuple(offsets))])
                    if raw.nbytes != nbytes:
                        raise ValueError(f"{path}: {fqn}: the buffers do not match the base's layout")
                    yield memoryview(raw)
                    pos = at + nbytes
                yield view[pos:]

            return entry_of_segments(segments(), block)
        finally:
            view.release()
