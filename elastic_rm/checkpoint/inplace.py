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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .fold_lock import JOURNAL, fold_lock, hidden_dirname
from .manifest import (
    BLOCK,
    FILE_HASH,
    MANIFEST,
    CorruptCheckpointError,
    file_digest,
    make_manifest,
    parse_manifest,
    step_dirname,
    write_file,
)
from .retention import chain, read_links

log = logging.getLogger(__name__)

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


def _check_layout(m: dict[str, Any]) -> dict[str, list[Item]]:
    """The fold manifest's layout, checked like its file names: each name a plain file name of the
    manifest's `files` (a layout cannot make a fold write outside its directory), each item
    [fqn, offsets, sizes, at, nbytes] with integers where they belong. FoldRefused otherwise."""
    layout, files = m.get("layout"), m.get("files")
    if not isinstance(layout, dict) or not isinstance(files, dict):
        raise FoldRefused("the fold manifest has no layout")

    def ints(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)

    for name, e in files.items():  # the folded files are checked with their block size
        block = e.get("block", BLOCK)
        if not isinstance(block, int) or isinstance(block, bool) or block < 1:
            raise FoldRefused(f"the fold manifest's entry of {name!r}: 'block' must be an integer >= 1")
    for name, items in layout.items():
        if not name or "/" in name or "\\" in name or name in (".", "..") or name not in files:
            raise FoldRefused(f"the fold manifest's layout names {name!r}, not a file of its manifest")
        if not isinstance(items, list):
            raise FoldRefused(f"the fold manifest's layout of {name}: not a list")
        for item in items:
            if not (
                isinstance(item, list)
                and len(item) == 5
                and isinstance(item[0], str)
                and ints(item[1])
                and ints(item[2])
                and ints(item[3:])
                and min(item[3:]) >= 0
            ):
                raise FoldRefused(f"the fold manifest's layout of {name}: malformed item {item!r:.200}")
    return layout


def _index(base_dir: Path, layout: dict[str, list[Item]]) -> dict[Any, tuple[str, int, int, list[int]]]:
    """Where each tensor piece of the base's files that `base_dir` holds lies; FoldRefused when an
    item does not fit in its file."""
    index = {}
    for name, items in layout.items():
        path = base_dir / name
        if path.is_file():
            size = path.stat().st_size
            for fqn, offsets, sizes, at, nbytes in items:
                if at + nbytes > size:
                    raise FoldRefused(f"{path}: {fqn} at {at}+{nbytes} lies past the file's end ({size})")
                index[(fqn, tuple(offsets))] = (name, at, nbytes, list(sizes))
    return index


def _checked_plan(
    base_dir: Path, index: dict[Any, Any], delta: Path
) -> list[tuple[str, int, int, list[int], dict[str, Any]]]:
    """The writes of `delta` into the base, with every row index and size checked against the base's
    layout (CorruptCheckpointError naming the delta otherwise; FoldRefused naming the base's file
    when its layout does not split a tensor into whole rows): nothing is written before every
    delta's plan is known to fit."""
    import numpy as np  # the agent's server folds too; numpy only when it does

    plan = _planned_writes(index, delta)
    _, data_at = _delta_header(delta)
    size = delta.stat().st_size
    with open(delta, "rb") as f:
        for name, _, nbytes, sizes, e in plan:
            key = ".".join(e["key"])
            lo, n = data_at + e["data"][0], e["data"][1]
            if lo < data_at or n < 0 or lo + n > size:
                raise CorruptCheckpointError(f"{delta}: {key}: its data lies outside the file")
            if e["rows"] is None:
                if n != nbytes:
                    raise CorruptCheckpointError(f"{delta}: {key}: size differs from the base's")
                continue
            if nbytes % max(1, sizes[0]):
                raise FoldRefused(f"{base_dir / name}: {key} of {nbytes} bytes is not {sizes[0]} whole rows")
            count = e["shape"][0]
            row = nbytes // max(1, sizes[0])
            r0 = data_at + e["rows"][0]
            if n != count * row or r0 < data_at or r0 + 8 * count > size:
                raise CorruptCheckpointError(f"{delta}: {key}: its rows do not match its data")
            f.seek(r0)
            rows = np.frombuffer(f.read(8 * count), dtype=np.int64) - e["offsets"][0]
            if count and (rows.min() < 0 or rows.max() >= sizes[0]):
                raise CorruptCheckpointError(f"{delta}: {key}: rows out of the base")
    return plan


Plans = list[tuple[Path, list[tuple[str, int, int, list[int], dict[str, Any]]]]]


def checked_plans(base_dir: Path, layout: dict[str, list[Item]], deltas: list[Path]) -> Plans:
    """Each delta with its checked writes into the base's files of `base_dir` (_checked_plan)."""
    index = _index(base_dir, layout)
    return [(d, _checked_plan(base_dir, index, d)) for d in deltas]


def apply_in_place(
    base_dir: Path,
    layout: dict[str, list[Item]],
    deltas: list[Path],
    on_stage: Stage | None = None,
    plans: Plans | None = None,
) -> int:
    """Write the deltas' entries, in order, into the base's files of `base_dir` (those it holds);
    returns the bytes written. Every delta is checked before the first write, unless `plans` (of
    checked_plans, for these deltas in this order) says it was: a fold checks them before it hides its
    base, and each check reads every delta's header and row ids. `on_stage("delta")` after each
    delta file."""
    import numpy as np  # the agent's server folds too; numpy only when it does

    if plans is None or [d for d, _ in plans] != list(deltas):
        plans = checked_plans(base_dir, layout, deltas)
    written = 0
    files = {name for _, plan in plans for name, *_ in plan}
    opened = {n: open(base_dir / n, "r+b") for n in sorted(files)}
    maps = {n: _mapped(f, writable=True) for n, f in opened.items()}
    dst = None
    try:
        for delta, plan in plans:
            with open(delta, "rb") as f:
                mapped = _mapped(f, writable=False)
            raw = np.frombuffer(mapped, dtype=np.uint8)
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
                    word = _word(row, at, lo)
                    words = row // word(0).itemsize
                    src = raw[lo : lo + n].view(word).reshape(count, words)
                    dst.view(word).reshape(sizes[0], words)[rows] = src
                written += n
            if on_stage is not None:
                on_stage("delta")
    finally:
        # a view of a map still bound (an exception left the loop) would make the close raise
        # BufferError in place of the real error
        del dst
        for m in maps.values():
            m.close()
        for f in opened.values():
            f.close()
    return written


def _mapped(f: Any, writable: bool) -> mmap.mmap:
    """The whole file mapped, its pages faulted in at once (MAP_POPULATE, where the platform has it):
    a fold writes rows all over a base and reads every delta whole, and one fault per page took
    longer than the copies."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    return mmap.mmap(f.fileno(), 0, flags=flags, prot=prot)


def _word(row: int, *offsets: int) -> Any:
    """The widest unsigned integer type that divides a row's bytes and the offsets of both sides: rows
    copied as a few words each, not byte by byte, take numpy's fancy assignment a fraction of the time."""
    import numpy as np

    for size, word in ((8, np.uint64), (4, np.uint32), (2, np.uint16)):
        if row % size == 0 and all(off % size == 0 for off in offsets):
            return word
    return np.uint8


def _delta_paths(directory: Path, steps: list[int]) -> list[Path]:
    out = []
    for s in steps:
        d = directory / step_dirname(s)
        names = json.loads((d / MANIFEST).read_bytes())["files"]
        out += [d / n for n in sorted(names) if n.endswith(".erm") and (d / n).is_file()]
    return out


def _checked_deltas(directory: Path, base: dict[str, Any], steps: list[int]) -> list[Path]:
    """The delta files of `steps` this directory must hold (those of the nodes whose files of the
    base it holds), each checked against its own manifest's size and checksum. FoldRefused naming
    the first that is missing or differs: checked before the base is touched."""
    base_dir = directory / step_dirname(base["step"])
    held = {
        e.get("node") for n, e in base["files"].items() if e.get("node") != "*" and (base_dir / n).is_file()
    }
    out = []
    for s in steps:
        d = directory / step_dirname(s)
        files = parse_manifest((d / MANIFEST).read_bytes(), str(d / MANIFEST))["files"]
        for name in sorted(files):
            e = files[name]
            if not name.endswith(".erm") or e.get("node") not in held:
                continue
            path = d / name
            if not path.is_file():
                raise FoldRefused(f"{path}: a delta of the chain is missing")
            if path.stat().st_size != e.get("size") or file_digest(path) != e.get(FILE_HASH):
                raise FoldRefused(f"{path}: the delta does not match its manifest (corrupt)")
            out.append(path)
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
    """`_fold_chain` under the directory's fold lock: a restore's drop of newer steps waits for it. A
    fold still pending there (one an error such as a full disk stopped) is finished first; while it
    cannot be, this one is refused: its journal is the only record of where that base is."""
    if not directory.is_dir():
        raise FoldRefused(f"{directory} holds no chain")
    with fold_lock(directory):
        _recover_fold(directory)
        if (directory / JOURNAL).exists():
            raise FoldRefused(f"{directory}: an earlier fold is still pending there ({JOURNAL})")
        _fold_chain(directory, body, on_stage)


def _fold_chain(directory: Path, body: bytes, on_stage: Stage | None = None) -> None:
    """Fold the chain that the manifest `body` (a full step S, with ``folded``: its base B and the
    digests of B's and S's manifests) names, in `directory` (a node's memory, or the replicas it holds
    for one peer). FoldRefused when the directory does not hold that chain (nothing touched);
    CorruptCheckpointError when the folded files do not match the manifest (recover_fold then drops
    the broken base; the chain is lost here, the other copies still hold it). `on_stage` is called
    between the steps (tests stop a fold there)."""
    stage = on_stage or (lambda _: None)
    try:
        m = parse_manifest(body, f"fold manifest of step {json_step(body)}")
    except CorruptCheckpointError as e:
        raise FoldRefused(str(e)) from None
    f = m.get("folded")
    if not isinstance(f, dict):
        raise FoldRefused("the manifest names no folded chain")
    layout = _check_layout(m)
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
    # every check before the base is touched: a delta that does not match its manifest, or a plan
    # that does not fit the base, refuses the fold here and leaves the chain restorable
    base_dir = directory / step_dirname(base)
    try:
        base_m = parse_manifest((base_dir / MANIFEST).read_bytes(), str(base_dir / MANIFEST))
        plans = checked_plans(base_dir, layout, _checked_deltas(directory, base_m, steps[1:]))
    except CorruptCheckpointError as e:
        raise FoldRefused(str(e)) from None
    except (OSError, KeyError, IndexError, TypeError, ValueError) as e:
        raise FoldRefused(f"{directory}: fold of step {top} cannot be planned: {e!r}") from None
    journal = {"v": 1, "base": base, "top": top, "steps": steps, "manifest": body.decode()}
    write_file(directory / JOURNAL, json.dumps(journal).encode(), sync=False)
    stage("journal")
    os.rename(directory / step_dirname(base), directory / hidden_dirname(base))
    stage("hidden")
    _finish(directory, journal, stage, plans)


def json_step(body: bytes) -> Any:
    try:
        return json.loads(body).get("step")
    except (ValueError, AttributeError, RecursionError):
        return None


def _finish(directory: Path, journal: dict[str, Any], stage: Stage, plans: Plans | None = None) -> None:
    base, top, steps = journal["base"], journal["top"], journal["steps"]
    body = journal["manifest"].encode()
    hidden = directory / hidden_dirname(base)
    if not hidden.is_dir() and (directory / step_dirname(base)).is_dir():  # stopped before hiding it
        os.rename(directory / step_dirname(base), hidden)
    if hidden.is_dir():
        if (hidden / MANIFEST).read_bytes() != body:
            new = parse_manifest(body, f"fold of step {top}")
            apply_in_place(hidden, _check_layout(new), _delta_paths(directory, steps[1:]), stage, plans)
            stage("applied")
            for name, e in new["files"].items():
                if (hidden / name).is_file() and name != MANIFEST and e.get("node") != "*":
                    path = hidden / name
                    if path.stat().st_size != e["size"] or file_digest(path) != e.get(FILE_HASH):
                        raise CorruptCheckpointError(f"{path}: folded file differs from its manifest")
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
    """`_recover_fold` under the directory's fold lock."""
    if not directory.is_dir():
        return None
    with fold_lock(directory):
        return _recover_fold(directory)


def _recover_fold(directory: Path) -> int | None:
    """Finish the fold a crash (or an error) interrupted in `directory`, if any; returns the folded step
    (None: no fold was pending, or it is still pending). A fold that cannot be finished (a delta gone,
    a file that does not match) is dropped, its base with it: the other copies of the chain (the
    peer's, the durable one) remain. One that failed on an error of the file system that may pass (no
    space left, an I/O error) stays pending, journal and base, and the next call tries again: its base
    may be this node's only copy of the chain."""
    path = directory / JOURNAL
    try:
        journal = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (ValueError, RecursionError):
        journal = None
    except OSError as e:
        log.warning("fold journal %s unreadable now (%s); the fold stays pending", path, e)
        return None
    try:
        if not isinstance(journal, dict):
            raise CorruptCheckpointError(f"{path}: unreadable fold journal")
        _finish(directory, journal, lambda _: None)
        log.info("finished the interrupted fold of step %s in %s", journal["top"], directory)
        return int(journal["top"])
    except OSError as e:
        if not isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
            log.warning(
                "the fold of step %s in %s stopped on %s; it stays pending and is tried again (its "
                "journal and hidden base are kept)",
                journal.get("top") if isinstance(journal, dict) else "?",
                directory,
                e,
            )
            return None
        _drop_fold(directory, journal, e)
        return None
    except (
        CorruptCheckpointError,
        FoldRefused,
        ValueError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
    ) as e:
        _drop_fold(directory, journal, e)
        return None


def _drop_fold(directory: Path, journal: Any, why: BaseException) -> None:
    log.warning("dropping an interrupted fold in %s that cannot be finished: %s", directory, why)
    if isinstance(journal, dict) and isinstance(journal.get("base"), int):
        shutil.rmtree(directory / hidden_dirname(journal["base"]), ignore_errors=True)
    (directory / JOURNAL).unlink(missing_ok=True)


__all__ = [
    "JOURNAL",
    "FoldRefused",
    "apply_in_place",
    "data_span",
    "fold_chain",
    "folded_manifest",
    "hidden_dirname",
    "recover_fold",
]
