"""An exact digest of a (sharded) training state that does not depend on how it is sharded.

Why: a sum of the values cannot tell rows swapped within a table, or between two tables of one shape,
from the right state, and float sums differ in their last bits with the order of their terms. Here each
value's bits are weighted by a key of its table (state-dict key) and its global position (row id, column)
and added as 64-bit integers, which wrap: the digest is the same whatever the sharding, the world size or
the order of the pieces, and any changed, swapped or moved value changes it.
"""

from __future__ import annotations

import hashlib

import torch

_C1 = 0xBF58476D1CE4E5B9 - (1 << 64)  # splitmix64's constants, as signed 64-bit integers
_C2 = 0x94D049BB133111EB - (1 << 64)
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


def _keys(name: str, start: int, count: int, salt: int) -> torch.Tensor:
    """Odd pseudo-random int64 keys of positions start..start+count-1 of ``name``."""
    pos = torch.arange(start, start + count, dtype=torch.int64)
    return _mix(pos ^ _mix(torch.tensor(name_key(name) ^ salt, dtype=torch.int64))) | 1


def piece_digest(name: str, offsets: list[int], piece: torch.Tensor) -> torch.Tensor:
    """The wrapping int64 sum of value bits x key(name, global row) x key(name, column) over one local
    piece of the tensor ``name`` that starts at global ``offsets`` (rows, columns). A 0-d int64 tensor.

    Linear in the bits with odd keys: any single changed value changes it, and a swap of two rows (or
    columns, or tables) changes it unless two pseudo-random 64-bit products happen to agree. Each row's
    columns are summed first, so it costs a few passes over the values (the sums of the float checks cost
    two)."""
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
    rows = _keys(name, offsets[0], t.shape[0], 0)
    if t.dim() == 2:
        bits = (bits * _keys(name, offsets[1], t.shape[1], _C1)).sum(dim=1)
    return (bits * rows).sum()


def digest_hex(sums: torch.Tensor) -> str:
    """A short hex string of int64 digests (12 characters: for logs and exact comparisons)."""
    return hashlib.sha256(" ".join(str(int(v)) for v in sums.tolist()).encode()).hexdigest()[:12]


def wrap_int64(value: int) -> int:
    """``value`` as the signed 64-bit integer that wrapping int64 addition (torch's all_reduce) gives."""
    return (value + (1 << 63)) % (1 << 64) - (1 << 63)


def combined_digest_hex(parts: list[list[int]]) -> str:
    """:func:`digest_hex` of the ranks' digests added together: what an all_reduce of each rank's int64
    digests and then :func:`digest_hex` give, from each rank's own part (no collective)."""
    totals = [wrap_int64(sum(column)) for column in zip(*parts, strict=True)]
    return digest_hex(torch.tensor(totals, dtype=torch.int64))
