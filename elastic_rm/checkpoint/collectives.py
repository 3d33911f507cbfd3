"""JSON and raw-byte collectives: the project's own data crosses processes as JSON, never pickle
(torch's *_object collectives pickle)."""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_bytes(data: bytes, pg: dist.ProcessGroup | None = None) -> list[bytes]:
    world = dist.get_world_size(pg)
    size = torch.tensor([len(data)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=pg)
    longest = max(int(s) for s in sizes)
    buf = torch.zeros(max(longest, 1), dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(out, buf, group=pg)
    return [bytes(o[: int(s)].numpy().tobytes()) for o, s in zip(out, sizes, strict=True)]


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
