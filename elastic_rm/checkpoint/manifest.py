"""Checkpoint directory layout, the JSON manifest (with its own checksum) and atomic file helpers.

Layout (one directory per simulated or real node, so nodes on one machine share nothing):
    <memory_root>/<node>/step-<N>/                files of this node's ranks, .metadata, manifest.json
    <memory_root>/<node>/replicas/<src>/step-<N>/ a peer's files, held for it
    <durable_dir>/step-<N>/                       all files, published by one atomic rename
A step directory counts only once its manifest.json exists; writers fill `step-<N>.tmp` first.
A full step holds DCP files; a delta step (manifest "kind": "delta") holds the rows touched since its
"parent" step and needs every step down to its "base" (elastic_rm/checkpoint/chain.py).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import shutil
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import xxhash

from .timeline import check_field as timeline_field_problem

MANIFEST = "manifest.json"
DCP_METADATA = ".metadata"
FORMAT = "elastic-rm-flash"
_STEP_RE = re.compile(r"^step-(\d{8,})$")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file or manifest failed its checksum, is truncated or missing."""


def step_dirname(step: int) -> str:
    return f"step-{step:08d}"


def committed_steps(directory: Path) -> list[int]:
    """Steps with a step directory (committed or not: a missing manifest is reported at restore).
    One directory read (os.scandir knows which entries are directories): retention lists every step
    of a chain at every save."""
    try:
        entries = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    steps = []
    with entries:
        for e in entries:
            m = _STEP_RE.match(e.name)
            if m and e.is_dir():
                steps.append(int(m.group(1)))
    return sorted(steps)


BLOCK = 16 << 20  # bytes per block checksum: a reader verifies only the blocks it reads

# File checksums detect corruption (flipped bits, torn or truncated copies), not tampering: the transport
# is authenticated instead (docs/guarantees.md). xxh3_128 hashes at ~12 GiB/s where sha256 managed
# 0.32 GiB/s on our 2-core CI machine, which made verifying a 1 GiB restore cost more than reading it.
# Manifests written before the switch name "sha256" and are still verified with it.
FILE_HASH = "xxh3_128"
FILE_HASHES = (FILE_HASH, "sha256")


def new_hasher(algorithm: str = FILE_HASH) -> Any:
    """A hashlib-style object (update, hexdigest) for one of FILE_HASHES."""
    if algorithm == "xxh3_128":
        return xxhash.xxh3_128()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown file checksum {algorithm!r}; expected one of {FILE_HASHES}")


def entry_hash(entry: dict[str, Any]) -> tuple[str, str]:
    """(algorithm, whole-file digest) of a manifest entry; its block digests use the same algorithm."""
    for alg in FILE_HASHES:
        if isinstance(entry.get(alg), str):
            return alg, entry[alg]
    raise CorruptCheckpointError(f"manifest entry names no file checksum (one of {FILE_HASHES})")


def digest(data: bytes | memoryview, algorithm: str = FILE_HASH) -> str:
    h = new_hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def file_digest(path: Path, algorithm: str = FILE_HASH, chunk: int = 1 << 20) -> str:
    """The whole file's checksum, read through one small buffer: a new buffer per read costs a page
    fault per page of it, which took longer than the hashing."""
    h = new_hasher(algorithm)
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f, memoryview(buf) as view:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_entry(path: Path, block: int = BLOCK, **extra: object) -> dict[str, object]:
    """Manifest entry: size, whole-file checksum and one checksum per `block` bytes (one mapped pass)."""
    with _mapped(path) as view:
        return {**entry_of_segments([view], block), **extra}


def entry_of_segments(segments: Iterable[memoryview | bytes], block: int = BLOCK) -> dict[str, Any]:
    """The manifest entry (size, checksum, block checksums) of the file the segments make, in order:
    the same as file_entry of that file, without reading it back."""
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


@contextmanager
def _mapped(path: Path) -> Iterator[memoryview]:
    """The file as a read-only memoryview (no copies, no page-faulting read buffers)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield memoryview(b"")
            return
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(m)
        try:
            yield view
        finally:
            view.release()
            m.close()


def _body_digest(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def make_manifest(body: dict[str, Any]) -> bytes:
    """Serialize a manifest body with a self-checksum, so a torn or edited manifest is detected."""
    doc = {"v": 1, "format": FORMAT, **body}
    doc["manifest_sha256"] = _body_digest(doc)
    return json.dumps(doc, sort_keys=True, indent=1).encode()


def parse_manifest(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: absurd nesting
        raise CorruptCheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("v") != 1:
        raise CorruptCheckpointError(f"{where}: not an elastic-rm v1 manifest")
    claimed = doc.pop("manifest_sha256", None)
    if claimed != _body_digest(doc):
        raise CorruptCheckpointError(f"{where}: manifest checksum mismatch (torn or edited)")
    doc["manifest_sha256"] = claimed
    _check_fields(doc, where)
    return doc


def _check_fields(doc: dict[str, Any], where: str) -> None:
    """The fields restore reads, with their types: the self-checksum detects a torn manifest, not a
    forged one (anyone can compute a checksum), so a hostile manifest must fail here, not crash restore.
    File names are plain names: a manifest cannot make restore read outside its step directory."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: malformed manifest: {what}")

    def is_int(v: Any, minimum: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= minimum

    if not is_int(doc.get("step"), 0) or not is_int(doc.get("world_size"), 1):
        raise bad("'step' and 'world_size' must be integers (>= 0, >= 1)")
    if not isinstance(doc.get("position"), dict):
        raise bad("'position' must be a JSON object")
    kind = doc.get("kind", "full")
    if kind not in ("full", "delta"):
        raise bad('\'kind\' must be "full" or "delta"')
    if kind == "delta":
        for k in ("base", "parent"):
            if not is_int(doc.get(k), 0) or doc[k] >= doc["step"]:
                raise bad(f"a delta's {k!r} must be an earlier step")
            if not isinstance(doc.get(f"{k}_sha256"), str):
                raise bad(f"a delta needs '{k}_sha256' (its {k} manifest's digest)")
        if doc["base"] > doc["parent"]:
            raise bad("a delta's base must not come after its parent")
    why = timeline_field_problem(doc.get("timeline"))
    if why is not None:
        raise bad(why)
    files = doc.get("files")
    if not isinstance(files, dict):
        raise bad("'files' must be a JSON object")
    for name, e in files.items():
        if not name or "/" in name or "\\" in name or name in (".", ".."):
            raise bad(f"file name {name!r} is not a plain file name")
        if (
            not isinstance(e, dict)
            or not any(isinstance(e.get(alg), str) for alg in FILE_HASHES)
            or not is_int(e.get("size"), 0)
        ):
            raise bad(
                f"entry of {name!r} needs a checksum ({' or '.join(FILE_HASHES)}: a string) "
                "and 'size' (integer >= 0)"
            )
        if not isinstance(e.get("node", ""), str):
            raise bad(f"entry of {name!r}: 'node' must be a string")
        if "blocks" in e and (
            not is_int(e.get("block"), 1)
            or not isinstance(e["blocks"], list)
            or not all(isinstance(b, str) for b in e["blocks"])
        ):
            raise bad(f"entry of {name!r}: 'block' must be an integer >= 1 and 'blocks' a list of strings")
        # one checksum per block of the file: a reader looks up the block of each range it reads, and a
        # list too short for the size would end the restore in an IndexError naming no file
        if "blocks" in e and len(e["blocks"]) != -(-e["size"] // e["block"]):
            raise bad(
                f"entry of {name!r}: {len(e['blocks'])} block checksums for {e['size']} bytes "
                f"in blocks of {e['block']}"
            )


def blocks_covering(block: int, ranges: list[tuple[int, int]]) -> list[int]:
    """The checksum blocks that (offset, length) ranges touch, sorted."""
    return sorted({b for off, n in ranges for b in range(off // block, (off + max(n, 1) - 1) // block + 1)})


def block_spans(entry: dict[str, Any], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(offset, length) byte spans of whole checksum blocks covering `ranges`, adjacent blocks merged:
    what a reader must fetch so that every block it reads can be verified."""
    bs, size = entry["block"], entry["size"]
    spans: list[tuple[int, int]] = []
    for b in blocks_covering(bs, ranges):
        lo, hi = b * bs, min(size, (b + 1) * bs)
        if spans and spans[-1][0] + spans[-1][1] == lo:
            spans[-1] = (spans[-1][0], hi - spans[-1][0])
        elif hi > lo:
            spans.append((lo, hi - lo))
    return spans


def verify_file(path: Path, entry: dict[str, Any], ranges: list[tuple[int, int]] | None = None) -> str | None:
    """None when the file matches its manifest entry, else why not. With `ranges` ((offset, length)
    pairs), only the blocks covering them are hashed: a resharding reader reads part of each file."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing"
    if size != entry["size"]:
        return f"size {size} != {entry['size']} (truncated or partial)"
    alg, whole = entry_hash(entry)
    if ranges is None or "blocks" not in entry:
        return None if file_digest(path, alg) == whole else "checksum mismatch (corrupt)"
    bs = entry["block"]
    # a read of no bytes (an empty tensor, possibly at the very end of the file) needs no block
    wanted = blocks_covering(bs, [(off, n) for off, n in ranges if n > 0])
    if wanted and wanted[-1] >= len(entry["blocks"]):  # a read past the end: a file this is not
        return f"a read at block {wanted[-1]} of a file of {len(entry['blocks'])} blocks (wrong file)"
    with _mapped(path) as view:
        for b in wanted:
            if digest(view[b * bs : (b + 1) * bs], alg) != entry["blocks"][b]:
                return f"checksum mismatch in block {b} (corrupt)"
    return None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file(path: Path, data: bytes, sync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())


def copy_file(src: Path, dst: Path, sync: bool) -> None:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo, length=16 << 20)
        if sync:
            fo.flush()
            os.fsync(fo.fileno())


def publish_dir(tmp: Path, final: Path, sync: bool) -> None:
    """Atomically make `tmp` visible as `final` (replacing an older `final` of the same step)."""
    if sync:
        fsync_dir(tmp)
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _chain_cache.pop(os.path.join(final, MANIFEST), None)  # the cache must not outlive the old version
    if sync:
        fsync_dir(final.parent)


CHAIN_FIELDS = (
    "step",
    "manifest_sha256",
    "kind",
    "parent",
    "parent_sha256",
    "base",
    "base_sha256",
    "timeline",
)
_CHAIN_CACHE_MAX = 4096
# path -> (version, fields, what callers made of the fields: chain_value's memo by maker)
_chain_cache: dict[str, tuple[tuple[int, int, int, int], dict[str, Any], dict[Any, Any]]] = {}


def chain_fields(step_dir: str | Path) -> dict[str, Any]:
    """The fields of a step's manifest that link it into a chain and name its timeline (CHAIN_FIELDS; the
    absent ones left out).

    Why cached: retention and the replica commit look at every step of a chain at every save, and a
    chain of a checkpoint per step holds hundreds. A step is published by renaming a new directory (which
    drops its entry), so one read per version of the file suffices; the version is its inode, size and
    modification and change times (an inode reused after a removal, or a timestamp as coarse as the
    file system's, alone could pass for the old version). Raises OSError or ValueError (RecursionError)
    like reading it would."""
    return dict(_chain_entry(step_dir)[1])


def chain_value(step_dir: str | Path, make: Callable[[dict[str, Any]], Any]) -> Any:
    """make(chain_fields(step_dir)), computed once per version of the manifest (the same cache): a
    listing of a chain of hundreds of steps at every save then costs a stat per step. `make` gets a
    copy of the fields; its result is shared, so it must be immutable."""
    _, fields, memo = _chain_entry(step_dir)
    if make not in memo:
        memo[make] = make(dict(fields))
    return memo[make]


def _chain_entry(
    step_dir: str | Path,
) -> tuple[tuple[int, int, int, int], dict[str, Any], dict[Any, Any]]:
    path = os.path.join(step_dir, MANIFEST)
    st = os.stat(path)
    key, version = path, (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)
    hit = _chain_cache.get(key)
    if hit is not None and hit[0] == version:
        return hit
    with open(path, "rb") as f:
        doc = json.loads(f.read())
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: not a JSON object")
    if len(_chain_cache) >= _CHAIN_CACHE_MAX:
        _chain_cache.clear()
    entry = _chain_cache[key] = (version, {k: doc[k] for k in CHAIN_FIELDS if k in doc}, {})
    return entry


def chain_steps(directory: Path, step: int) -> list[int]:
    """`step` and, for a delta, the steps it needs in `directory` (its parent, the parent's parent, ...
    down to its base), as far as their manifests name them."""
    out, cur = [step], step
    while True:
        try:
            doc = chain_fields(directory / step_dirname(cur))
        except (OSError, ValueError, RecursionError):
            return out
        parent = doc.get("parent") if isinstance(doc, dict) and doc.get("kind") == "delta" else None
        if not isinstance(parent, int) or isinstance(parent, bool) or not 0 <= parent < cur:
            return out
        out.append(parent)
        cur = parent


def prune_steps(directory: Path, keep: int) -> None:
    """Keep the newest `keep` step directories and every step those need (the chain of a delta, down to
    its base); drop stale tmp directories older than those."""
    steps = committed_steps(directory)
    kept = {d for s in (steps[-keep:] if keep > 0 else []) for d in chain_steps(directory, s)}
    for s in steps:
        if s not in kept:
            shutil.rmtree(directory / step_dirname(s), ignore_errors=True)
    newest = steps[-1] if steps else None
    if directory.is_dir():
        for p in directory.iterdir():
            m = re.match(r"^step-(\d{8,})\.tmp", p.name)
            if m and newest is not None and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)
