"""Where a checkpoint's files can be read from, fastest first, and a DCP reader that takes each file
from the first place holding a copy whose checksum matches the manifest.

A source is anything with steps / manifest bytes / a local path for a file (and, to be read from two
threads of one restore, a ``fork(name)`` giving a copy safe to use beside it). `DirectorySource` covers
one directory (this node's memory, a replica it holds for a peer, the durable copy);
`HttpPeerSource` is a peer node's memory, fetched from that node's agent (elastic_rm/checkpoint/server.py)
into a cache in this node's own memory. Nodes never read each other's directories, even on one machine:
a node that is gone has lost its memory copy.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadPlan

from elastic_rm.checkpoint import timeline
from elastic_rm.checkpoint.dcp_metadata import SafeMetadataReader, refuse_byte_items
from elastic_rm.checkpoint.manifest import (
    DCP_METADATA,
    MANIFEST,
    CorruptCheckpointError,
    block_spans,
    blocks_covering,
    committed_steps,
    parse_manifest,
    step_dirname,
    verify_file,
)
from elastic_rm.checkpoint.node_memory import memory_dirs
from elastic_rm.checkpoint.peers import PeerClient, PeerEndpoint, PeerError
from elastic_rm.checkpoint.retention import newest_timeline

log = logging.getLogger(__name__)


class CheckpointSource(Protocol):
    name: str

    def steps(self) -> list[int]: ...

    def manifest_bytes(self, step: int) -> bytes | None: ...

    def file_path(self, step: int, file: str) -> Path | None: ...


class DirectorySource:
    """The committed step directories under `root`."""

    def __init__(self, name: str, root: Path) -> None:
        self.name = name
        self.root = Path(root)

    def steps(self) -> list[int]:
        return committed_steps(self.root)

    def newest_timeline(self) -> timeline.Key | None:
        return newest_timeline([self.root])

    def manifest_bytes(self, step: int) -> bytes | None:
        path = self.root / step_dirname(step) / MANIFEST
        return path.read_bytes() if path.is_file() else None

    def file_path(self, step: int, file: str) -> Path | None:
        path = self.root / step_dirname(step) / file
        return path if path.is_file() else None

    def fork(self, name: str) -> DirectorySource:
        """Itself: it keeps no state, so another thread of a restore reads through it as it is."""
        return self


def memory_sources(name: str, root: Path) -> list[CheckpointSource]:
    """A node's memory directory: its own steps, then one source per peer whose replicas it holds
    (``replicas/<src>/``, sorted). Each directory is a source of its own because two of them can hold
    different checkpoints of one step (a replica left from before a restore): a file is read only
    with the manifest of the directory that holds it."""
    root = Path(root)
    peers = memory_dirs(root)[1:]
    return [DirectorySource(name, root)] + [DirectorySource(f"{name}/replica:{p.name}", p) for p in peers]


class SourceUnavailable(RuntimeError):
    """A source that should hold a file could not deliver it (a peer died, timed out or refused)."""


class HttpPeerSource:
    """A peer node's memory (its own steps and the replicas it keeps), through its agent's checkpoint
    server. Files are downloaded into `cache_dir` (in this node's memory) and verified by the resolver
    like any other copy. After a connection failure the peer counts as down for this restore: a dead or
    hung peer costs one timeout, not one per file."""

    def __init__(self, peer: PeerEndpoint, cache_dir: Path, timeout_s: float = 30.0) -> None:
        self.name = f"peer:{peer.node}"
        self.client = PeerClient(peer, timeout_s)
        self.cache_dir = Path(cache_dir)
        self.down: str | None = None  # why, once a request failed
        self.bytes_fetched = 0
        self._listed: tuple[list[int], Any] | None = None  # the peer's listing, read once per restore
        self._manifests: dict[int, bytes | None] = {}  # the manifests asked for, read once per restore
        # the checksum blocks each downloaded copy holds (None: the whole file), so that a reader asking
        # for more of a file (a delta's entries after its header) is sent only the blocks it lacks
        self._have: dict[Path, set[int] | None] = {}
        self._parent: HttpPeerSource | None = None  # the source this one was forked from

    def fork(self, name: str) -> HttpPeerSource:
        """A copy for another thread of the same restore: a connection and a cache of its own
        (``<cache_dir>/<name>``, dropped with this one's), starting from what this one has read (the
        listing, the manifests, whether the peer is down). Its bytes count here once it is cleared."""
        twin = HttpPeerSource(self.client.peer, self.cache_dir / name, self.client.timeout_s)
        twin.down = self.down
        twin._listed = self._listed
        twin._manifests = dict(self._manifests)
        twin._parent = self
        return twin

    def _failed(self, what: str, e: PeerError) -> None:
        if e.status is None:  # could not talk to it at all: do not try again in this restore
            self.down = str(e)
        log.warning("checkpoint source %s: %s failed (%s); trying the next source", self.name, what, e)

    def _listing(self) -> tuple[list[int], Any]:
        if self.down:
            return [], None
        if self._listed is None:
            try:
                self._listed = self.client.listing()
            except PeerError as e:
                self._failed("listing steps", e)
                return [], None
        return self._listed

    def steps(self) -> list[int]:
        return self._listing()[0]

    def newest_timeline(self) -> timeline.Key | None:
        """As the peer's server read it from manifests that pass their checksum (store.py)."""
        return timeline.from_json(self._listing()[1])

    def manifest_bytes(self, step: int) -> bytes | None:
        """Read once per restore, as the listing is (a restore asks for a step's manifest once to find
        the chain and again for each file it resolves; no step changes while every rank restores)."""
        if self.down:
            return None
        if step not in self._manifests:
            try:
                self._manifests[step] = self.client.manifest(step)
            except PeerError as e:
                self._failed(f"manifest of step {step}", e)
                return None
        return self._manifests[step]

    def file_path(self, step: int, file: str) -> Path | None:
        return self.file_blocks(step, file, None, None)

    def file_blocks(
        self, step: int, file: str, entry: dict[str, Any] | None, ranges: list[tuple[int, int]] | None
    ) -> Path | None:
        """Download the file, or with `entry` and `ranges` only the checksum blocks covering the ranges
        (the rest of the local copy stays zero; the resolver verifies exactly those blocks and DCP reads
        only those ranges)."""
        if self.down:
            raise SourceUnavailable(f"peer unreachable ({self.down})")
        dest = self.cache_dir / step_dirname(step) / file
        spans, size, need, have = None, 0, set(), set()
        if entry is not None and ranges is not None and "blocks" in entry:
            have = self._have.get(dest, set()) if dest.is_file() else set()  # a copy gone holds none
            if have is None:
                return dest
            bs, size = entry["block"], entry["size"]
            need = set(blocks_covering(bs, ranges)) - have
            if not need:
                return dest
            spans = block_spans(entry, [(b * bs, 1) for b in sorted(need)])
        more = spans is not None and bool(have)  # the copy holds other blocks already
        try:
            got = self.client.download(step, file, dest, spans, size, into_existing=more)
        except PeerError as e:
            if e.status is None:
                self.down = str(e)
            raise SourceUnavailable(f"download failed ({e})") from None
        if got is None:
            return None
        self.bytes_fetched += got
        if spans is None:
            self._have[dest] = None
            return dest
        # only now are the new blocks whole: a download cut midway left part of them written, and they
        # stay out of `have` until a later download fetches them again
        self._have[dest] = have | need
        return dest

    def clear(self) -> None:
        """Drop the downloaded copies (after the load: they only hold memory) and close the connection
        the reads kept, which holds a thread of the peer's server until it times out. The peer counts
        as up again: a failure skips it for the rest of *that* restore, and a source passed to two
        restores in a row (``restore(sources=...)``) must not skip a peer that is back. A fork hands
        its bytes, and a connection failure it met, to the source it was forked from: that restore's
        next step (its base, or an older chain's fork) then skips the peer, not waiting on it again."""
        shutil.rmtree(self.cache_dir, ignore_errors=True)
        self._have.clear()
        self._listed = None
        self._manifests.clear()
        self.client.close()
        if self._parent is not None:
            self._parent.bytes_fetched += self.bytes_fetched
            self.bytes_fetched = 0
            if self.down and not self._parent.down:
                self._parent.down = self.down
        self.down = None


def newest_timeline_of(sources: Sequence[CheckpointSource]) -> timeline.Key | None:
    """The newest timeline the sources' sound manifests name (timeline.py): what a restore's vote on the
    current timeline reads, from every source the restore may read. A source without
    ``newest_timeline()`` (one passed to ``restore(sources=...)``) has every manifest it lists read."""
    keys = []
    for src in sources:
        newest = getattr(src, "newest_timeline", None)
        if newest is not None:
            keys.append(newest())
            continue
        for step in src.steps():
            data = src.manifest_bytes(step)
            try:
                keys.append(timeline.key_of(parse_manifest(data, src.name)) if data is not None else None)
            except CorruptCheckpointError:
                continue
    return max((k for k in keys if k is not None), default=None)


def find_manifest(
    step: int, sources: Sequence[CheckpointSource], live: Callable[[dict[str, Any]], bool] | None = None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The first manifest of `step` that parses, passes its checksum and (given `live`) lies on the
    run's current timeline (timeline.py), and why others did not."""
    problems = []
    for src in sources:
        data = src.manifest_bytes(step)
        if data is None:
            continue
        try:
            manifest = parse_manifest(data, f"{src.name} step {step}")
        except CorruptCheckpointError as e:
            problems.append(str(e))
            continue
        if live is None or live(manifest):
            return manifest, problems
        problems.append(f"{src.name} step {step}: of a timeline an earlier restore abandoned")
    if not problems:
        problems.append(f"step {step}: no manifest in any source (partial checkpoint)")
    return None, problems


def find_manifest_of(
    step: int, sha: str, sources: Sequence[CheckpointSource]
) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """The manifest of `step` whose digest is `sha` (the one a delta was built on), from the first source
    holding it; else None, why the others failed, and the sources holding another checkpoint of `step`."""
    problems, others = [], []
    for src in sources:
        data = src.manifest_bytes(step)
        if data is None:
            continue
        try:
            m = parse_manifest(data, f"{src.name} step {step}")
        except CorruptCheckpointError as e:
            problems.append(str(e))
            continue
        if m["manifest_sha256"] == sha:
            return m, problems, others
        others.append(src.name)
    return None, problems, others


class FileResolver:
    """Maps a checkpoint file name to a verified local path, trying sources in order. A source whose
    manifest of the step is another checkpoint (another run's, a replaced step) is passed over: its
    files are never read into this one, even where their sizes match and checksums are not verified."""

    def __init__(
        self, step: int, manifest: dict[str, Any], sources: Sequence[CheckpointSource], verify: bool = True
    ) -> None:
        self.step = step
        self.verify = verify
        self.files: dict[str, Any] = manifest["files"]
        self.sources = list(sources)
        self.sha = manifest.get("manifest_sha256")
        self.resolved: dict[str, tuple[str, Path]] = {}
        self.verify_s = 0.0
        self._foreign: dict[str, bool] = {}  # source name -> holds another checkpoint of this step

    def _holds_another(self, src: CheckpointSource) -> bool:
        """Does `src` hold a sound manifest of this step that is not this one? (A source without one,
        or with a corrupt one, may still hold good files: the checksums decide.)"""
        if src.name not in self._foreign:
            data = src.manifest_bytes(self.step) if self.sha is not None else None
            try:
                other = data is not None and parse_manifest(data, src.name)["manifest_sha256"] != self.sha
            except CorruptCheckpointError:
                other = False
            self._foreign[src.name] = other
        return self._foreign[src.name]

    def path(self, file: str, ranges: list[tuple[int, int]] | None = None) -> Path:
        """A local path of a copy of `file` whose checksums match: of the whole file, or with `ranges`
        of the blocks covering them. The first answer for a file is kept (and reported in `resolved`)."""
        if file not in self.resolved:
            self.resolved[file] = self._find(file, ranges)
        return self.resolved[file][1]

    def peek(self, file: str, ranges: list[tuple[int, int]]) -> Path:
        """Like path(), for a first look (a delta file's header, before the reader knows which of its
        entries it needs): the answer is not kept; a later path() of the file asks again."""
        return self._find(file, ranges)[1]

    def _find(self, file: str, ranges: list[tuple[int, int]] | None) -> tuple[str, Path]:
        entry = self.files.get(file)
        if entry is None:
            raise CorruptCheckpointError(f"step {self.step}: file {file!r} is not in the manifest")
        why = []
        for src in self.sources:
            if self._holds_another(src):
                why.append(f"{src.name}: holds another checkpoint of step {self.step}")
                continue
            partial = getattr(src, "file_blocks", None)  # a network source fetches only what is read
            try:
                if partial is not None and ranges is not None:
                    p = partial(self.step, file, entry, ranges)
                else:
                    p = src.file_path(self.step, file)
            except SourceUnavailable as e:
                why.append(f"{src.name}: {e}")
                log.warning(
                    "checkpoint step %d: %s from %s: %s; trying the next copy", self.step, file, src.name, e
                )
                continue
            if p is None:
                continue
            t0 = time.perf_counter()
            bad = (
                verify_file(p, entry, ranges) if self.verify or file == DCP_METADATA else _size_only(p, entry)
            )
            self.verify_s += time.perf_counter() - t0
            if bad is None:
                return src.name, p
            why.append(f"{src.name}: {bad}")
            log.warning(
                "checkpoint step %d: %s in %s is %s; trying the next copy", self.step, file, src.name, bad
            )
        if not why:
            why.append("no source holds it")
        raise CorruptCheckpointError(f"step {self.step}: no good copy of {file} ({'; '.join(why)})")


def _size_only(path: Path, entry: dict[str, Any]) -> str | None:
    size = path.stat().st_size
    return None if size == entry["size"] else f"size {size} != {entry['size']} (truncated or partial)"


class _ResolvingFileSystem(FileSystem):
    def __init__(self, resolver: FileResolver) -> None:
        super().__init__()
        self.resolver = resolver

    def concat_path(self, path: str | Path, suffix: str) -> Path:  # type: ignore[override]
        return self.resolver.path(str(suffix))


class ResolvingReader(SafeMetadataReader):
    """DCP FileSystemReader whose every file (the .metadata included) comes from the resolver.
    All files a rank needs are verified in prepare_local_plan, before any tensor is overwritten, so a
    corrupt checkpoint fails the load collectively and leaves the model as it was. The .metadata is
    unpickled admitting only DCP's metadata classes (elastic_rm/checkpoint/dcp_metadata.py): a copy from a
    peer is bytes from the network."""

    def __init__(self, resolver: FileResolver) -> None:
        super().__init__(path=f"elastic-rm-step-{resolver.step}")
        self.fs = _ResolvingFileSystem(resolver)
        self.resolver = resolver

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        refuse_byte_items(plan)
        ranges: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
        for file, rs in sorted(ranges.items()):
            self.resolver.path(file, rs)
        return super().prepare_local_plan(plan)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | Path) -> bool:
        return False
