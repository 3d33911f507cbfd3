"""JSON and raw-byte collectives: the project's own data crosses processes as JSON, never pickle
(torch's *_object collectives pickle)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist

INLINE_BYTES = 16 << 10  # a rank's data up to this size is gathered in one round


def all_gather_bytes(data: bytes, pg: dist.ProcessGroup | None = None) -> list[bytes]:
    """Every rank's `data`, in rank order. One round (length and data together) when every rank's data
    fits INLINE_BYTES, as the small JSON of a checkpoint's save does; a second round otherwise."""
    world = dist.get_world_size(pg)
    buf = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if data and len(data) <= INLINE_BYTES:
        buf[8 : 8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=pg)
    sizes = [int(o[:8].view(torch.int64)) for o in out]
    if max(sizes) <= INLINE_BYTES:
        return [bytes(o[8 : 8 + n].numpy().tobytes()) for o, n in zip(out, sizes, strict=True)]
    big = torch.zeros(max(sizes), dtype=torch.uint8)
    if data:
        big[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(big) for _ in range(world)]
    dist.all_gather(out, big, group=pg)
    return [bytes(o[:n].numpy().tobytes()) for o, n in zip(out, sizes, strict=True)]


def all_gather_json(obj: Any, pg: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's JSON-able `obj`, in rank order."""
    return [json.loads(b) for b in all_gather_bytes(json.dumps(obj).encode(), pg)]


def broadcast_bytes(data: bytes | None, src: int = 0, pg: dist.ProcessGroup | None = None) -> bytes:
    """`data` from global rank `src` (ignored elsewhere) on every rank."""
    is_src = dist.get_rank() == src
    size = torch.tensor([len(data) if is_src and data is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=pg)
    buf = torch.zeros(max(int(size), 1), dtype=torch.uint8)
    if is_src and data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=pg)
    return bytes(buf[: int(size)].numpy().tobytes())
