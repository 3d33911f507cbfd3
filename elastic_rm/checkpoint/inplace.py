"""Fold a differential chain into its base in place: the base's files are rewritten where they lie, so
a fold holds no second base beside the old chain.

Why it is safe to do in place: a delta holds the full values of the rows it took (never increments),
so applying a chain's deltas in order onto its base gives the chain's newest state from any mix of
the base and that state: every byte either still holds the base's value or already the folded one,
and the bytes that differ are exactly those some delta covers. A crash in the middle of a fold is
therefore finished by applying the same deltas again. The steps of a fold:

1. a journal (``fold.json``) names the base, the steps folded and the new base's manifest (its
   checksums were computed before the base was touched, from the writer's snapshot buffers);
2. the base's directory is renamed to ``fold-<B>``: no reader finds it (readers list ``step-<N>``
   directories), and the old deltas, without their base, restore nothing;
3. each delta's rows are written at their offsets in the base's DCP files (the layout, from the base's
   manifest: where each tensor's raw bytes start in its file);
4. the files are checked against the new manifest, which then replaces the old one;
5. the folded deltas are removed, the directory becomes ``step-<S>``, the journal goes.

`recover_fold` finishes a fold a crash interrupted (from step 3 again, or from where the commit
stopped). The node's writer (the checkpointer) folds its own memory this way and the node's checkpoint
server folds a peer's replica the same way, from the deltas it already holds. Torch-free: the agent's
server imports it. Where a DCP file keeps a tensor: DCP writes each tensor with torch.save, a zip
archive whose one ``data/0`` record holds the raw bytes uncompressed; the zip's CRC fields of a
rewritten record keep the base's values (torch.load does not read them; the manifest's checksums cover
every byte of the file).
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import shutil
import struct
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .manifest import (
    BLOCK,
    FILE_HASH,
    MANIFEST,
    CorruptCheckpointError,
    file_entry,
    make_manifest,
    new_hasher,
    parse_manifest,
    step_dirname,
    write_file,
)
from .retention import chain, read_links

log = logging.getLogger(__name__)

JOURNAL = "fold.json"
DELTA_MAGIC = b"ERMDELT1"
ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}

# a layout item: [fqn, chunk offsets, chunk sizes, where its raw bytes start in the file, their length]
Item = list[Any]
Stage = Callable[[str], None]


class FoldRefused(Exception):
    """The directory does not hold the chain a fold names (nothing was touched)."""


def hidden_dirname(step: int) -> str:
    return f"fold-{step:08d}"


class _Window:
    """A read-only file object over [offset, offset + length) of an open file (one zip archive)."""

    def __init__(self, f: Any, offset: int, length: int) -> None:
        self.f, self.offset, self.length, self.pos = f, offset, length, 0

    def seekable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else (self.pos + pos if whence == 1 else self.length + pos)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.offset + self.pos)
        data = self.f.read(max(0, n))
        self.pos += len(data)
        return data


def data_span(path: Path, offset: int, length: int) -> tuple[int, int]:
    """(where the raw bytes start in `path`, their length) of the tensor torch.save wrote at
    [offset, offset + length). ValueError unless it is one uncompressed ``data/0`` record."""
    with open(path, "rb") as f:
        try:
            records = zipfile.ZipFile(_Window(f, offset, length)).infolist()
        except zipfile.BadZipFile as e:
            raise ValueError(f"{path}@{offset}: not a torch.save archive ({e})") from None
        data = [r for r in records if "/data/" in r.filename and not r.filename.endswith(".pkl")]
        if len(data) != 1 or not data[0].filename.endswith("/data/0"):
            raise ValueError(f"{path}@{offset}: {len(data)} storages, not one")
        rec = data[0]
        if rec.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"{path}@{offset}: the tensor's bytes are compressed")
        f.seek(offset + rec.header_offset)
        head = f.read(30)
        if len(head) != 30 or head[:4] != b"PK\x03\x04":
            raise ValueError(f"{path}@{offset}: no local zip header at the tensor's record")
        name_len, extra_len = struct.unpack("<HH", head[26:30])
        return offset + rec.header_offset + 30 + name_len + extra_len, rec.file_size


def entry_of_segments(segments: Iterable[memoryview | bytes], block: int = BLOCK) -> dict[str, Any]:
    """The manifest entry (size, checksum, block checksums) of the file the segments make, in order:
    the same as manifest.file_entry of that file, without writing it."""
    whole, blocks, cur = new_hasher(), [], new_hasher()
    size = filled = 0
    for seg in segments:
        view = memoryview(seg).cast("B")
        at = 0
        while at < len(view):
            take = min(block - filled, len(view) - at)
            part = view[at : at + take]
            whole.update(part)
            cur.update(part)
            filled += take
            at += take
            if filled == block:
                blocks.append(cur.hexdigest())
                cur, filled = new_hasher(), 0
        size += len(view)
    if filled:
        blocks.append(cur.hexdigest())
    return {FILE_HASH: whole.hexdigest(), "size": size, "block": block, "blocks": blocks}


def _delta_header(where: Path) -> tuple[list[dict[str, Any]], int]:
    """A delta file's entries and where its data starts (elastic_rm/checkpoint/delta_file.py)."""
    with open(where, "rb") as f:
        lead = f.read(16)
        if len(lead) < 16 or lead[:8] != DELTA_MAGIC:
            raise CorruptCheckpointError(f"{where}: not a delta checkpoint file")
        n = int.from_bytes(lead[8:16], "little")
        head = f.read(n)
    try:
        doc = json.loads(head)
        return list(doc["entries"]), 16 + n + (-(16 + n)) % 64
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CorruptCheckpointError(f"{where}: malformed delta header") from None


def _planned_writes(
    index: dict[tuple[str, tuple[int, ...]], tuple[str, int, int, list[int]]], delta: Path
) -> list[tuple[str, int, int, list[int], dict[str, Any]]]:
    """(file, at, nbytes, sizes, entry) for every entry of `delta`; CorruptCheckpointError when one
    has no place in the base (checked for every delta before the base is touched)."""
    entries, _ = _delta_header(delta)
    out = []
    for e in entries:
        key = (".".join(e["key"]), tuple(e["offsets"]))
        hit = index.get(key)
        if hit is None:
            raise CorruptCheckpointError(f"{delta}: {key[0]} at {list(key[1])} has no place in the base")
        name, at, nbytes, sizes = hit
        shape = e["extent"] if e["rows"] is not None else e["shape"]
        if list(shape) != sizes or e["dtype"] not in ITEMSIZE:
            raise CorruptCheckpointError(f"{delta}: {key[0]}: shape {shape} is not the base's {sizes}")
        out.append((name, at, nbytes, sizes, e))
    return out


def apply_in_place(
    base_dir: Path, layout: dict[str, list[Item]], deltas: list[Path], on_stage: Stage | None = None
) -> int:
    """Write the deltas' entries, in order, into the base's files of `base_dir` (those it holds);
    returns the bytes written. Every delta is checked before the first write. `on_stage("delta")`
    after each delta file."""
    import numpy as np  # the agent's server folds too; numpy only when it does

    index = {}
    for name, items in layout.items():
        if (base_dir / name).is_file():
            for fqn, offsets, sizes, at, nbytes in items:
                index[(fqn, tuple(offsets))] = (name, at, nbytes, list(sizes))
    plans = [(d, _planned_writes(index, d)) for d in deltas]
    written = 0
    files = {name for _, plan in plans for name, *_ in plan}
    opened = {n: open(base_dir / n, "r+b") for n in sorted(files)}
    maps = {n: mmap.mmap(f.fileno(), 0) for n, f in opened.items()}
    try:
        for delta, plan in plans:
            raw = np.fromfile(delta, dtype=np.uint8)
            _, data_at = _delta_header(delta)
            for name, at, nbytes, sizes, e in plan:
                dst = np.frombuffer(maps[name], dtype=np.uint8, count=nbytes, offset=at)
                lo, n = data_at + e["data"][0], e["data"][1]
                if e["rows"] is None:
                    if n != nbytes:
                        raise CorruptCheckpointError(f"{delta}: {'.'.join(e['key'])}: size differs")
                    dst[:] = raw[lo : lo + n]
                else:
                    count = e["shape"][0]
                    row = nbytes // max(1, sizes[0])
                    r0 = data_at + e["rows"][0]
                    rows = raw[r0 : r0 + 8 * count].view(np.int64) - e["offsets"][0]
                    if count and (rows.min() < 0 or rows.max() >= sizes[0] or n != count * row):
                        raise CorruptCheckpointError(f"{delta}: {'.'.join(e['key'])}: rows out of the base")
                    dst.reshape(sizes[0], row)[rows] = raw[lo : lo + n].reshape(count, row)
                written += n
                del dst
            if on_stage is not None:
                on_stage("delta")
    finally:
        for m in maps.values():
            m.close()
        for f in opened.values():
            f.close()
    return written


def _delta_paths(directory: Path, steps: list[int]) -> list[Path]:
    out = []
    for s in steps:
        d = directory / step_dirname(s)
        names = json.loads((d / MANIFEST).read_bytes())["files"]
        out += [d / n for n in sorted(names) if n.endswith(".erm") and (d / n).is_file()]
    return out


def folded_manifest(base: dict[str, Any], top: dict[str, Any], files: dict[str, Any]) -> bytes:
    """The manifest of the base `base` (a parsed manifest) folded up to the delta `top`: a full step
    of top's step and training position, with the folded files' entries `files` (every node's), and
    ``folded`` naming the chain (the base's and top's manifest digests)."""
    fields = {k: v for k, v in base.items() if k not in ("v", "format", "manifest_sha256")}
    folded = {
        "base": base["step"],
        "base_sha256": base["manifest_sha256"],
        "top_sha256": top["manifest_sha256"],
    }
    return make_manifest(
        {
            **fields,
            "step": top["step"],
            "position": top["position"],
            "created_unix": top["created_unix"],
            "files": {**base["files"], **files},
            "folded": folded,
        }
    )


def fold_chain(directory: Path, body: bytes, on_stage: Stage | None = None) -> None:
    """Fold the chain that the manifest `body` (a full step S, with ``folded``: its base B and the
    digests of B's and S's manifests) names, in `directory` (a node's memory, or the replicas it holds
    for one peer). FoldRefused when the directory does not hold that chain (nothing touched);
    CorruptCheckpointError when the folded files do not match the manifest (recover_fold then drops
    the broken base; the chain is lost here, the other copies still hold it). `on_stage` is called
    between the steps (tests stop a fold there)."""
    stage = on_stage or (lambda _: None)
    m = parse_manifest(body, f"fold manifest of step {json_step(body)}")
    f = m.get("folded")
    if not isinstance(f, dict) or not isinstance(m.get("layout"), dict):
        raise FoldRefused("the manifest names no folded chain or no layout")
    top, base = m["step"], f.get("base")
    links = read_links(directory)
    steps = chain(links, top) if top in links else None
    if (
        steps is None
        or steps[0] != base
        or len(steps) < 2
        or links[base].sha != f.get("base_sha256")
        or links[top].sha != f.get("top_sha256")
    ):
        raise FoldRefused(f"{directory} does not hold the chain of step {top} on base {base}")
    journal = {"v": 1, "base": base, "top": top, "steps": steps, "manifest": body.decode()}
    write_file(directory / JOURNAL, json.dumps(journal).encode(), sync=False)
    stage("journal")
    os.rename(directory / step_dirname(base), directory / hidden_dirname(base))
    stage("hidden")
    _finish(directory, journal, stage)


def json_step(body: bytes) -> Any:
    try:
        return json.loads(body).get("step")
    except (ValueError, AttributeError, RecursionError):
        return None


def _finish(directory: Path, journal: dict[str, Any], stage: Stage) -> None:
    base, top, steps = journal["base"], journal["top"], journal["steps"]
    body = journal["manifest"].encode()
    hidden = directory / hidden_dirname(base)
    if not hidden.is_dir() and (directory / step_dirname(base)).is_dir():  # stopped before hiding it
        os.rename(directory / step_dirname(base), hidden)
    if hidden.is_dir():
        if (hidden / MANIFEST).read_bytes() != body:
            new = parse_manifest(body, f"fold of step {top}")
            apply_in_place(hidden, new["layout"], _delta_paths(directory, steps[1:]), stage)
            stage("applied")
            for name, e in new["files"].items():
                if (hidden / name).is_file() and name != MANIFEST and e.get("node") != "*":
                    got = file_entry(hidden / name, e.get("block", BLOCK))
                    if got[FILE_HASH] != e.get(FILE_HASH) or got["size"] != e["size"]:
                        raise CorruptCheckpointError(
                            f"{hidden / name}: folded file differs from its manifest"
                        )
            write_file(hidden / (MANIFEST + ".new"), body, sync=False)
            os.replace(hidden / (MANIFEST + ".new"), hidden / MANIFEST)
            stage("manifest")
        for s in steps[1:]:
            shutil.rmtree(directory / step_dirname(s), ignore_errors=True)
        stage("deltas")
        os.rename(hidden, directory / step_dirname(top))
        stage("renamed")
    elif (directory / step_dirname(top) / MANIFEST).read_bytes() != body:
        raise CorruptCheckpointError(f"{directory}: fold of step {top}: its base is gone")
    (directory / JOURNAL).unlink(missing_ok=True)


def recover_fold(directory: Path) -> int | None:
    """Finish the fold a crash interrupted in `directory`, if any; returns the folded step (None: no
    fold was pending). A fold that cannot be finished (a delta gone, a file that does not match) is
    dropped, its base with it: the other copies of the chain (the peer's, the durable one) remain."""
    path = directory / JOURNAL
    try:
        journal = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError):
        journal = None
    try:
        if not isinstance(journal, dict):
            raise CorruptCheckpointError(f"{path}: unreadable fold journal")
        _finish(directory, journal, lambda _: None)
        log.info("finished the interrupted fold of step %s in %s", journal["top"], directory)
        return int(journal["top"])
    except (CorruptCheckpointError, OSError, ValueError, KeyError, TypeError) as e:
        log.warning("dropping an interrupted fold in %s that cannot be finished: %s", directory, e)
        if isinstance(journal, dict) and isinstance(journal.get("base"), int):
            shutil.rmtree(directory / hidden_dirname(journal["base"]), ignore_errors=True)
        path.unlink(missing_ok=True)
        return None


__all__ = [
    "FoldRefused",
    "apply_in_place",
    "data_span",
    "entry_of_segments",
    "fold_chain",
    "folded_manifest",
    "recover_fold",
]
