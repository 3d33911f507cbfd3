"""What a node's checkpoint server serves and accepts, without the HTTP: its flash-checkpoint memory.

Why apart from the HTTP: these are the rules that keep a node's memory directory sound whoever calls
them. A node directory holds its own committed steps (``step-<N>/``) and the replicas it keeps for
peers (``replicas/<src>/step-<N>/``). Reads see committed steps only (a manifest is present). A replica
arrives file by file into ``step-<N>.tmp/``, hashed as it arrives, and is published by one rename only
when every file matches the manifest; a node pushes one step at a time. A delta step (the rows changed
since its parent step) is accepted only on top of its chain (its parent, back to its base, each the
checkpoint it names), and pruning keeps whole chains (retention.py). A replica chain is folded into its base
in place on the pusher's request, from the deltas held here (inplace.py). Uploads are size-limited and
refused when the memory file system lacks the room. A refusal is a :class:`Refused` with the HTTP status
that says what went wrong.
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, BinaryIO

from .inplace import FoldRefused, fold_chain, json_step, recover_fold
from .manifest import (
    FILE_HASH,
    MANIFEST,
    CorruptCheckpointError,
    committed_steps,
    entry_hash,
    file_digest,
    new_hasher,
    parse_manifest,
    publish_dir,
    step_dirname,
    write_file,
)
from .node_memory import held_bytes, memory_dirs
from .peers import safe_name
from .retention import chain, link_of, newest_timeline, prune_chains, read_links
from .timeline import as_field

log = logging.getLogger(__name__)

MAX_FILE_BYTES = 256 << 30  # one uploaded checkpoint file
FREE_RESERVE_BYTES = 256 << 20  # an upload must leave this much free in the memory file system
CHUNK = 4 << 20
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a write refused for want of room: 507


POOLED_BUFFERS = 8  # block buffers kept mapped between uploads (more concurrent uploads map their own)
_POOL: list[mmap.mmap] = []
_POOL_LOCK = threading.Lock()


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


@contextmanager
def _block_buffer() -> Iterator[memoryview]:
    """One upload's block buffer: an anonymous mapping, reused from a small pool of them.

    Why not ``rfile.read(CHUNK)``: each request runs on a thread of its own, each thread allocates from
    one of glibc's arenas (up to 8 per core), and once a freed 4 MiB block has raised glibc's mmap
    threshold, later blocks come from those arenas and stay with them. An agent then grew by about 5 MiB
    per arena, one step at each round a node joined (benchmarks/recovery/memory). Why a pool, not a new
    mapping per upload: a fresh mapping for every replica upload of the final checkpoint made the
    straggler swap's drain slower (docs/benchmarks.md, ab-swap-bytes-upload.json)."""
    with _POOL_LOCK:
        buf = _POOL.pop() if _POOL else mmap.mmap(-1, CHUNK)
    view = memoryview(buf)
    try:
        yield view
    finally:
        view.release()
        with _POOL_LOCK:
            keep = len(_POOL) < POOLED_BUFFERS
            if keep:
                _POOL.append(buf)
        if not keep:
            buf.close()


class Refused(Exception):
    """A request the store will not carry out; ``code`` is the HTTP status that says why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class CheckpointStore:
    """One node's memory directory (a path, or a callable: the node id may change when it rejoins)."""

    def __init__(self, node_dir: Path | Callable[[], Path], max_file_bytes: int = MAX_FILE_BYTES) -> None:
        self._node_dir = node_dir if callable(node_dir) else (lambda d=Path(node_dir): d)
        self.max_file_bytes = max_file_bytes
        self._lock = threading.Lock()  # replica upload state and commits
        # (src, step) -> name -> (size, checksum) of the files uploaded so far
        self._pending: dict[tuple[str, int], dict[str, tuple[int, str]]] = {}
        # the node directory's bytes at their largest, sampled right before each replica publish after
        # which a prune may remove steps (a base's and the next `keep` ones of its source: the new files
        # beside the old chain); in between a chain only grows
        self._peak = 0
        self._samples_due: dict[str, int] = {}

    @property
    def node_dir(self) -> Path:
        return self._node_dir()

    def recover_replicas(self) -> list[str]:
        """Finish (or drop) the replica folds a crash of this server interrupted, in every replica root,
        before anything reads them: otherwise a replica stays hidden until its source's next commit.
        Returns the sources whose fold was finished."""
        rep = self.node_dir / "replicas"
        if not rep.is_dir():
            return []
        done = []
        with self._lock:
            for root in sorted(p for p in rep.iterdir() if p.is_dir() and safe_name(p.name)):
                if recover_fold(root) is not None:
                    done.append(root.name)
        return done

    # ---- reads -----------------------------------------------------------------------------------------
    def _step_dirs(self, step: int) -> list[Path]:
        """Committed copies of `step` here, own first, then the replicas (sorted by source node)."""
        root = self.node_dir
        dirs = [root / step_dirname(step)]
        rep = root / "replicas"
        if rep.is_dir():
            dirs += sorted(p / step_dirname(step) for p in rep.iterdir() if safe_name(p.name))
        return [d for d in dirs if (d / MANIFEST).is_file()]

    def listing(self) -> dict[str, Any]:
        root = self.node_dir

        def committed(d: Path) -> list[int]:
            return [s for s in committed_steps(d) if (d / step_dirname(s) / MANIFEST).is_file()]

        rep = root / "replicas"
        replicas = {}
        if rep.is_dir():
            replicas = {
                p.name: committed(p) for p in sorted(rep.iterdir()) if safe_name(p.name) and p.is_dir()
            }
        held = held_bytes(root)
        newest = newest_timeline(memory_dirs(root))  # a restore's vote on the current timeline reads it
        return {
            "v": 1,
            "node": root.name,
            "steps": committed(root),
            "replicas": replicas,
            "timeline": as_field(newest) if newest is not None else None,
            "held_bytes": held,
            "peak_bytes": max(self._peak, held),
        }

    def manifest_path(self, step: int) -> Path:
        dirs = self._step_dirs(step)
        if not dirs:
            raise Refused(404, f"step {step} is not held here")
        return dirs[0] / MANIFEST

    def file_path(self, step: int, name: str) -> Path:
        """The first copy of `name` in a step directory whose manifest is the one manifest_path() serves
        and lists it: a reader gets files of that checkpoint only, never a same-named file of another
        checkpoint of the step (a replica left from before a restore)."""
        dirs = self._step_dirs(step)
        served = (dirs[0] / MANIFEST).read_bytes() if dirs else b""
        for d in dirs:
            try:
                body = (d / MANIFEST).read_bytes()
                files = json.loads(body).get("files", {}) if body == served else {}
            except (OSError, ValueError):
                continue
            if isinstance(files, dict) and name in files and (d / name).is_file():
                return d / name
        raise Refused(404, f"no copy of {name} of step {step} here (not held, or not in its manifest)")

    def replica_links(self, src: str) -> list[dict[str, Any]]:
        """The chain fields of the steps held for `src` (a pusher finds what a delta's chain lacks)."""
        return [asdict(link) for link in read_links(self._replica_root(src)).values()]

    # ---- replica uploads -------------------------------------------------------------------------------
    def _replica_root(self, src: str) -> Path:
        return self.node_dir / "replicas" / src

    def begin(self, src: str, step: int) -> None:
        """A node pushes one step at a time: its unfinished uploads of other steps are dropped."""
        with self._lock:
            for key in [k for k in self._pending if k[0] == src]:
                del self._pending[key]
                shutil.rmtree(self._replica_root(src) / (step_dirname(key[1]) + ".tmp"), ignore_errors=True)
            tmp = self._replica_root(src) / (step_dirname(step) + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            self._pending[(src, step)] = {}

    def receive(self, src: str, step: int, name: str, length: int, rfile: BinaryIO) -> None:
        """Stream `length` bytes into the replica's temp directory, hashing as they arrive."""
        with self._lock:
            if (src, step) not in self._pending:
                raise Refused(409, f"no upload of step {step} from {src} in progress: POST .../begin first")
        tmp = self._replica_root(src) / (step_dirname(step) + ".tmp")
        if length > self.max_file_bytes:
            raise Refused(413, f"{name}: {length} bytes is over this server's limit of {self.max_file_bytes}")
        free = shutil.disk_usage(tmp).free
        if length + FREE_RESERVE_BYTES > free:
            raise Refused(507, f"{name}: {length} bytes do not fit in {tmp.parent} ({free} bytes free)")
        h = new_hasher(FILE_HASH)
        part = tmp / (name + ".part")
        got = 0
        try:
            with _block_buffer() as buf, open(part, "wb") as f:
                while got < length:
                    with buf[: min(CHUNK, length - got)] as block:
                        n = rfile.readinto(block)
                    if not n:
                        break
                    with buf[:n] as data:
                        h.update(data)
                        f.write(data)
                    got += n
            if got != length:
                raise Refused(400, f"{name}: got {got} of {length} bytes (connection cut)")
            os.replace(part, tmp / name)
        except OSError as e:
            if e.errno not in _NO_ROOM:
                raise
            # the free space checked above went meanwhile (another upload, a worker's save): the same
            # refusal as when it was short from the start, not an internal error with a traceback
            raise Refused(507, f"{name}: no room left in {tmp.parent} ({e.strerror})") from None
        finally:
            part.unlink(missing_ok=True)
        with self._lock:
            pending = self._pending.get((src, step))
            if pending is None:  # a newer begin (or a commit) raced us: this upload is void
                raise Refused(409, f"the upload of step {step} from {src} was restarted meanwhile")
            pending[name] = (got, h.hexdigest())

    def commit(self, src: str, step: int, body: bytes, keep: int) -> None:
        """Check every uploaded file against the manifest, then publish the replica atomically. A commit
        of the manifest already published for that step succeeds again: a pusher that lost the answer
        (its connection closed) resends it and must not be told the replica failed."""
        root = self._replica_root(src)
        tmp = root / (step_dirname(step) + ".tmp")
        # the memory sample walks the whole node directory: taken before the lock (uploads and commits
        # of other sources wait on it), when this commit may be one to sample (a base, or one after it)
        sample = held_bytes(self.node_dir) if self._may_sample(src, body) else None
        with self._lock:
            recover_fold(root)  # one this server's crash interrupted: finished (or dropped) first
            pending = self._pending.pop((src, step), None)
            if pending is None and _read_or_none(root / step_dirname(step) / MANIFEST) == body:
                return
            if pending is None:
                raise Refused(409, f"no upload of step {step} from {src} in progress: POST .../begin first")
            try:
                manifest = self._check(src, step, body, pending, tmp)
            except CorruptCheckpointError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise Refused(422, f"replica refused: {e}") from None
            link = link_of(manifest)
            if link.kind == "delta" and chain({**read_links(root), step: link}, step) is None:
                shutil.rmtree(tmp, ignore_errors=True)
                raise Refused(
                    424,
                    f"step {step} of {src} is a delta of step {link.parent} (base {link.base}), and this "
                    f"node does not hold that chain for {src} (or holds another checkpoint of it): push "
                    "the chain's missing steps, base first",
                )
            try:
                write_file(tmp / MANIFEST, body, sync=False)
            except OSError as e:  # the upload goes: nothing else would remove it before a later prune
                shutil.rmtree(tmp, ignore_errors=True)
                if e.errno not in _NO_ROOM:
                    raise
                raise Refused(
                    507, f"replica of step {step}: no room left for its manifest ({e.strerror})"
                ) from None
            due = keep + 1 if link.kind == "full" else self._samples_due.get(src, 0)
            if due > 0 and sample is not None:
                self._peak = max(self._peak, sample)
            self._samples_due[src] = max(0, due - 1)
            publish_dir(tmp, root / step_dirname(step), sync=False)
            if due > 0:  # after a base and the next `keep` steps a delta only extends the kept chain
                prune_chains(root, keep)
        log.info("replica of step %d (%s) from %s committed (%d files)", step, link.kind, src, len(pending))

    def fold(self, src: str, step: int, body: bytes, keep: int) -> None:
        """Fold `src`'s replica chain into its base in place, up to `step` (body: the folded base's
        manifest, which names the chain). The node directory is sampled first: the chain is at its
        largest right before a fold. Other replica uploads and commits wait for it (the lock)."""
        root = self._replica_root(src)
        if json_step(body) != step:
            raise Refused(400, f"the fold's manifest is not of step {step}")
        with self._lock:
            recover_fold(root)
            self._peak = max(self._peak, held_bytes(self.node_dir))
            try:
                fold_chain(root, body)
            except FoldRefused as e:
                raise Refused(424, f"fold of {src}'s replica refused: {e}") from None
            except (CorruptCheckpointError, OSError, ValueError) as e:
                recover_fold(root)
                raise Refused(422, f"fold of {src}'s replica to step {step} failed: {e}") from None
            prune_chains(root, keep)
        log.info("replica of %s folded in place into a base at step %d", src, step)

    def _may_sample(self, src: str, body: bytes) -> bool:
        """Whether commit() will sample the memory held: a full step (a new base) or one of the steps
        after it still due. Read without the lock: at worst one sample too many."""
        if self._samples_due.get(src, 0) > 0:
            return True
        try:
            doc = json.loads(body)
        except ValueError:
            return False
        return isinstance(doc, dict) and doc.get("kind", "full") != "delta"

    @staticmethod
    def _check(
        src: str, step: int, body: bytes, pending: dict[str, tuple[int, str]], tmp: Path
    ) -> dict[str, Any]:
        """The parsed manifest; CorruptCheckpointError unless the uploaded files of `src` are exactly
        the manifest's."""
        manifest = parse_manifest(body, f"replica of step {step} from {src}")
        if manifest["step"] != step:
            raise CorruptCheckpointError(f"the manifest is of step {manifest['step']}, not {step}")
        wanted = {n: e for n, e in manifest["files"].items() if e.get("node") in (src, "*")}
        problems = [f"{n}: missing" for n in sorted(set(wanted) - set(pending))]
        problems += [f"{n}: not a file of {src} in the manifest" for n in sorted(set(pending) - set(wanted))]
        for n in sorted(set(wanted) & set(pending)):
            size, got = pending[n]
            alg, expected = entry_hash(wanted[n])
            if alg != FILE_HASH and size == wanted[n]["size"]:  # a manifest of an older version
                got = file_digest(tmp / n, alg)
            if size != wanted[n]["size"] or got != expected:
                problems.append(
                    f"{n}: size/checksum do not match the manifest (corrupt in transit or at source)"
                )
        if problems:
            raise CorruptCheckpointError("; ".join(problems))
        return manifest
