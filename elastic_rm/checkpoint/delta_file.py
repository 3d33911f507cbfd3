"""The file of a differential checkpoint: the rows one rank copied at a save, without pickle.

Layout: 8 bytes of magic, the header's length (8 bytes, little-endian), the header (JSON), zero padding
to a multiple of 64 bytes, then raw little-endian tensor bytes. The header lists one entry per piece:
the state-dict path of the tensor (a list of keys), the piece's global offsets, the shape of the values
stored, their dtype, where the values lie (offset and length after the header), and for a piece taken by
rows, where its global row ids (int64, along dim 0) lie. An entry without row ids holds the whole piece.
The manifest carries the file's checksum; reading checks that every entry lies inside the file.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_rm.checkpoint.manifest import CorruptCheckpointError, entry_of_segments

MAGIC = b"ERMDELT1"
HEAD = 16  # the magic and the header's length
DELTA_SUFFIX = ".erm"
ALIGN = 64
# checksum blocks of a delta file: small enough that a rank restoring a few shards reads (and a peer
# sends) little more than their rows, few enough that the manifest stays small
MIN_BLOCK = 64 << 10
MAX_BLOCKS = 64
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}

if sys.byteorder != "little":  # the raw bytes are torch's in-memory layout
    raise ImportError("elastic_rm delta checkpoints need a little-endian machine")


@dataclass
class DeltaPiece:
    """Part of one tensor: with `rows`, the rows (global ids along dim 0) of the piece at `offsets`;
    without, the whole piece."""

    key: list[str]
    offsets: list[int]
    values: torch.Tensor
    rows: torch.Tensor | None = None
    extent: list[int] | None = None  # the shape of the piece the rows come from (None: values' shape)


def checksum_block(size: int) -> int:
    """The manifest's checksum block size for a delta file of `size` bytes."""
    return max(MIN_BLOCK, -(-size // MAX_BLOCKS))


def header_end(path: Path) -> int:
    """Where the header of the delta file at `path` ends (only its first HEAD bytes are read)."""
    with open(path, "rb") as f:
        lead = f.read(HEAD)
    if len(lead) < HEAD or lead[:8] != MAGIC:
        raise CorruptCheckpointError(f"{path}: not a valid delta checkpoint file: wrong magic bytes")
    return HEAD + int.from_bytes(lead[8:16], "little")


def _raw(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _pad(n: int) -> int:
    return (-n) % ALIGN


def write_delta(path: Path, pieces: list[DeltaPiece]) -> int:
    """Write `pieces` to `path`; returns the file's size."""
    segments = _segments(pieces)
    _write(path, segments)
    return sum(len(seg) for seg in segments)


def write_delta_entry(path: Path, pieces: list[DeltaPiece]) -> dict[str, Any]:
    """Write `pieces` to `path`; returns the file's manifest entry (size, checksum and block checksums
    at checksum_block), hashed from the bytes in memory: a save every step does not map and page in
    the file it has just written to hash it."""
    segments = _segments(pieces)
    _write(path, segments)
    return entry_of_segments(segments, checksum_block(sum(len(seg) for seg in segments)))


def _write(path: Path, segments: list[memoryview]) -> None:
    with open(path, "wb") as f:
        for seg in segments:
            f.write(seg)


def _segments(pieces: list[DeltaPiece]) -> list[memoryview]:
    """The bytes of the delta file of `pieces`, in order: its header (padded), then each tensor's raw
    bytes (padded)."""
    entries: list[dict[str, Any]] = []
    blobs: list[memoryview] = []
    at = 0

    def place(t: torch.Tensor) -> list[int]:
        nonlocal at
        raw = _raw(t)
        span = [at, raw.nbytes]
        blobs.append(raw)
        at += raw.nbytes
        if _pad(at):
            blobs.append(memoryview(bytes(_pad(at))))
            at += _pad(at)
        return span

    for p in pieces:
        if p.values.dtype not in _NAMES:
            raise TypeError(f"{'.'.join(p.key)}: dtype {p.values.dtype} cannot go into a delta checkpoint")
        entry: dict[str, Any] = {
            "key": p.key,
            "offsets": list(p.offsets),
            "extent": list(p.extent) if p.extent is not None else list(p.values.shape),
            "shape": list(p.values.shape),
            "dtype": _NAMES[p.values.dtype],
            "data": place(p.values),
            "rows": None,
        }
        if p.rows is not None:
            entry["rows"] = place(p.rows.to(torch.int64))
        entries.append(entry)
    header = json.dumps({"v": 1, "entries": entries}, separators=(",", ":")).encode()
    lead = MAGIC + len(header).to_bytes(8, "little") + header
    return [memoryview(lead + bytes(_pad(len(lead)))), *blobs]


class DeltaReader:
    """A delta file's header, read at once; `pieces()` gives the entries a caller wants (a rank
    restoring into another plan reads only the pieces that overlap its shards) as views of the file
    mapped into memory: a restore copies each row once, from the file into its shard."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._size = os.fstat(f.fileno()).st_size
            lead = f.read(16)
            n = int.from_bytes(lead[8:16], "little") if len(lead) == 16 else 0
            self._buf = lead + f.read(min(n, max(0, self._size - 16)))
        self.entries, self.data_at = self._header()  # data_at: where the tensor bytes start

    def _bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: not a valid delta checkpoint file: {what}")

    def _header(self) -> tuple[list[dict[str, Any]], int]:
        buf = self._buf
        if len(buf) < 16 or buf[:8] != MAGIC:
            raise self._bad("wrong magic bytes")
        n = int.from_bytes(buf[8:16], "little")
        if 16 + n > self._size:
            raise self._bad("header runs past the end of the file")
        try:
            doc = json.loads(bytes(buf[16 : 16 + n]))
        except (ValueError, RecursionError) as e:
            raise self._bad(f"header is not JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("v") != 1 or not isinstance(doc.get("entries"), list):
            raise self._bad("header is not a v1 delta header")
        data_at = 16 + n + _pad(16 + n)
        for e in doc["entries"]:
            self._check(e, self._size - data_at)
        return doc["entries"], data_at

    def _check(self, e: Any, room: int) -> None:
        def span_ok(s: Any) -> bool:
            return (
                isinstance(s, list)
                and len(s) == 2
                and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in s)
                and s[0] + s[1] <= room
            )

        ok = (
            isinstance(e, dict)
            and isinstance(e.get("key"), list)
            and all(isinstance(k, str) for k in e["key"])
            and isinstance(e.get("offsets"), list)
            and isinstance(e.get("shape"), list)
            and isinstance(e.get("extent"), list)
            and len(e["extent"]) == len(e["offsets"]) == len(e["shape"])
            and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0
                for x in e["shape"] + e["offsets"] + e["extent"]
            )
            and e.get("dtype") in DTYPES
            and span_ok(e.get("data"))
            and (e.get("rows") is None or span_ok(e["rows"]))
        )
        if not ok:
            raise self._bad(f"malformed entry {str(e)[:200]}")
        numel = 1
        for x in e["shape"]:
            numel *= x
        if numel * DTYPES[e["dtype"]].itemsize != e["data"][1]:
            raise self._bad(f"entry {'.'.join(e['key'])}: shape and byte length disagree")
        if e["rows"] is not None and (not e["shape"] or e["rows"][1] != 8 * e["shape"][0]):
            raise self._bad(f"entry {'.'.join(e['key'])}: row ids and values disagree")

    def _tensor(self, mem: Any, span: list[int], dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        """A view of the mapped file's bytes: values are read where they lie, not copied first."""
        if span[1] == 0:
            return torch.empty(shape, dtype=dtype)
        at = self.data_at + span[0]
        if at + span[1] > len(mem):
            raise self._bad("an entry runs past the end of the file")
        return torch.frombuffer(mem, dtype=torch.uint8, count=span[1], offset=at).view(dtype).reshape(shape)

    def pieces(
        self, wanted: Callable[[list[str], list[int], list[int]], bool] | None = None
    ) -> list[DeltaPiece]:
        """The entries for which wanted(key, offsets, extent) holds (all without `wanted`)."""
        chosen = [e for e in self.entries if wanted is None or wanted(e["key"], e["offsets"], e["extent"])]
        if not chosen:
            return []
        with open(self.path, "rb") as f:
            # private: a write to a piece's values stays in this process; the tensors keep the map open
            mem = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        out = []
        for e in chosen:
            rows = None
            if e["rows"] is not None:
                rows = self._tensor(mem, e["rows"], torch.int64, [e["shape"][0]])
            values = self._tensor(mem, e["data"], DTYPES[e["dtype"]], e["shape"])
            out.append(DeltaPiece(e["key"], e["offsets"], values, rows, e["extent"]))
        return out
