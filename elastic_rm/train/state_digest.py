"""An exact digest of a (sharded) training state that does not depend on how it is sharded.

Why: a sum of the values cannot tell rows swapped within a table, or between two tables of one shape,
from the right state, and float sums differ in their last bits with the order of their terms. Here each
value is hashed with its table (state-dict key) and its global position (row id, column) and the hashes
are added as 64-bit integers, which wrap: the digest is the same whatever the sharding, the world size
or the order of the pieces, and any changed, swapped or moved value changes it.
"""

from __future__ import annotations

import hashlib

import torch

_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's constants, as signed 64-bit integers
_C2 = 0x94D049BB133111EB - (1 << 64)
_COLS = 1 << 24  # columns per row kept apart in a position id (embedding dims are far below)
_BITS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser, wrapping int64 arithmetic."""
    x = (x ^ _shr(x, 30)) * _C1
    x = (x ^ _shr(x, 27)) * _C2
    return x ^ _shr(x, 31)


def name_key(name: str) -> int:
    """A signed 64-bit key of a table's (or any tensor's) name."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little", signed=True)


def piece_digest(name: str, offsets: list[int], piece: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of hash(name, global row, column, value bits) over one local piece of the
    tensor ``name`` that starts at global ``offsets`` (rows, columns). A 0-d int64 tensor."""
    t = piece.detach().contiguous()
    if t.dim() == 0:
        t, offsets = t.view(1), [0]
    if t.dim() > 2:
        if any(offsets[2:]):
            raise ValueError(f"{name}: pieces split beyond the second dimension are not supported")
        offsets = [offsets[0], offsets[1] * (t[0, 0].numel() if t.numel() else 1)]
        t = t.reshape(t.shape[0], -1)
    if t.dtype.is_floating_point or t.dtype.is_complex:
        bits = t.view(_BITS[t.element_size()]).to(torch.int64)
    else:
        bits = t.to(torch.int64)
    rows = torch.arange(offsets[0], offsets[0] + t.shape[0], dtype=torch.int64)
    if t.dim() == 2:
        cols = torch.arange(offsets[1], offsets[1] + t.shape[1], dtype=torch.int64)
        pos = rows.view(-1, 1) * _COLS + cols.view(1, -1)
    else:
        pos = rows * _COLS
    return _mix(_mix(pos ^ name_key(name)) ^ bits).sum()


def digest_hex(sums: torch.Tensor) -> str:
    """A short hex string of int64 digests (12 characters: for logs and exact comparisons)."""
    return hashlib.sha256(" ".join(str(int(v)) for v in sums.tolist()).encode()).hexdigest()[:12]
