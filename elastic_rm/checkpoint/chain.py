"""Differential checkpoints as a chain: a full step (the base), then delta steps that each hold the rows
touched since the step before (their parent). What a delta takes from a state dict, how it is applied
to a state dict of any plan, and which steps a delta needs at restore.

A sharded table's tensors (its weight and its fused optimizer state) are taken by rows when their
first dimension indexes the table's rows (a weight, a per-element state such as Adagrad's) or a whole
number of copies of them (row-wise Adagrad's momentum of a column-wise table keeps one block of rows per
column shard). Anything else of a table is copied whole and the table is named in `tables_full`.
Dense tensors (dense layers, data-parallel tables, their optimizer state) are copied whole by one
rank (the one whose file of the base holds them; rank 0 without a base layout): they are the same on
every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor

from elastic_rm.checkpoint.delta_file import HEAD, DeltaPiece, DeltaReader, header_end
from elastic_rm.checkpoint.manifest import CorruptCheckpointError
from elastic_rm.checkpoint.snapshot import local_pieces
from elastic_rm.checkpoint.sources import CheckpointSource, FileResolver, find_manifest_of


@dataclass
class DeltaTake:
    pieces: list[DeltaPiece] = field(default_factory=list)
    bytes: int = 0
    rows_touched: int = 0  # over all tables taken by rows (every rank counts the same)
    rows_total: int = 0
    tables_full: list[str] = field(default_factory=list)


def _leaves(state: Any, path: list[str]) -> list[tuple[list[str], Any]]:
    if isinstance(state, dict):
        return [leaf for k, v in state.items() for leaf in _leaves(v, [*path, str(k)])]
    return [(path, state)]


def _table_of(path: list[str], tables: dict[str, int]) -> str | None:
    """The table whose weight ("model", key) or fused optimizer state ("optim", key, ...) this is."""
    if len(path) >= 2 and path[0] in ("model", "optim") and path[1] in tables:
        return path[1]
    return None


def _row_space(rows: torch.Tensor, n: int, size0: int) -> torch.Tensor | None:
    """Indices along dim 0 of a tensor of `size0` rows holding `size0 // n` blocks of a table's n rows."""
    if n <= 0 or size0 % n:
        return None
    return torch.cat([rows + j * n for j in range(size0 // n)]) if size0 > n else rows


@torch.no_grad()
def take_delta(
    state: dict,
    touched: dict[str, torch.Tensor],
    tables: dict[str, int],
    rank: int,
    writers: dict[str, int] | None = None,
) -> DeltaTake:
    """Copy from `state` (live tensors) what a delta of the rows in `touched` holds on this rank.
    A dense tensor is copied by the rank `writers` names for its flattened key (the rank whose file of
    the base holds it, so that a fold in place finds it on the same node), else by rank 0."""
    out = DeltaTake()
    full: set[str] = set()  # tables a tensor of which is copied whole
    sharded: set[str] = set()  # tables sharded over the ranks (data-parallel ones are dense)
    for path, value in _leaves(state, []):
        table = _table_of(path, tables)
        if isinstance(value, ShardedTensor):
            space = None
            if table is not None and table in touched:
                # the global size from the metadata: value.size() goes through ShardedTensor's
                # __torch_function__ (its argument validation), a fixed cost per tensor and save
                space = _row_space(touched[table], tables[table], value.metadata().size[0])
            for off, t in local_pieces(value):
                if space is None:
                    out.pieces.append(DeltaPiece(path, off, t.detach().to("cpu", copy=True)))
                    continue
                # the space is sorted: the rows of this piece are one slice of it
                lo, hi = torch.searchsorted(space, torch.tensor([off[0], off[0] + t.shape[0]])).tolist()
                sel = space[lo:hi]
                values = t.index_select(0, (sel - off[0]).to(t.device)).to("cpu")  # host memory
                out.pieces.append(DeltaPiece(path, off, values, sel, list(t.shape)))
            if table is not None:
                sharded.add(table)
            if space is None and path[0] in ("model", "optim"):
                full.add(table or path[1])  # a sharded tensor of no table the tracker knows: by its key
        elif isinstance(value, torch.Tensor):
            if rank == (writers or {}).get(".".join(path), 0):
                out.pieces.append(DeltaPiece(path, [0] * value.dim(), value.detach().to("cpu", copy=True)))
        else:
            raise TypeError(f"{'.'.join(path)}: a {type(value).__name__} cannot go into a delta checkpoint")
    out.tables_full = sorted(full)
    for table in sorted((sharded & set(touched)) - full):
        out.rows_total += tables[table]
        out.rows_touched += len(touched[table])
    out.bytes = sum(
        p.values.numel() * p.values.element_size() + (8 * len(p.rows) if p.rows is not None else 0)
        for p in out.pieces
    )
    return out


def _target(state: Any, key: list[str]) -> Any:
    for k in key:
        if not isinstance(state, dict) or k not in state:
            return None
        state = state[k]
    return state


def _overlap(
    a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
) -> tuple[tuple[slice, ...], tuple[slice, ...]] | None:
    """Slices into a and into b of the box both cover, or None."""
    sa, sb = [], []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        sa.append(slice(lo - ao, hi - ao))
        sb.append(slice(lo - bo, hi - bo))
    return tuple(sa), tuple(sb)


def _rows_within(
    rows: torch.Tensor, values: torch.Tensor, lo: int, hi: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The row ids in [lo, hi) and their values. Rows a delta took are sorted, so they are one slice of
    both (views, no copy of the values); unsorted ids (not written by take_delta) are selected by mask."""
    if len(rows) < 2 or bool((rows[1:] >= rows[:-1]).all()):
        a, b = torch.searchsorted(rows, torch.tensor([lo, hi], dtype=rows.dtype)).tolist()
        return rows[a:b], values[a:b]
    mask = (rows >= lo) & (rows < hi)
    return rows[mask], values[mask]


@torch.no_grad()
def apply_delta(state: dict, pieces: list[DeltaPiece]) -> int:
    """Write the pieces' values into the parts of `state` this rank holds; returns elements written."""
    written = 0
    for p in pieces:
        target = _target(state, p.key)
        if not isinstance(target, torch.Tensor):  # a ShardedTensor is one too; absent: not on this rank
            continue
        for off, t in local_pieces(target):
            if t.dim() != p.values.dim():
                raise CorruptCheckpointError(
                    f"{'.'.join(p.key)}: delta has {p.values.dim()} dims, state {t.dim()}"
                )
            if t.dim() == 0:
                t.copy_(p.values)
                written += 1
                continue
            if p.rows is None:
                box = _overlap(off, t.shape, p.offsets, p.values.shape)
                if box is not None:
                    t[box[0]].copy_(p.values[box[1]])
                    written += t[box[0]].numel()
                continue
            rest = _overlap(off[1:], t.shape[1:], p.offsets[1:], p.values.shape[1:])
            if rest is None and t.dim() > 1:
                continue
            rows, src = _rows_within(p.rows, p.values, off[0], off[0] + t.shape[0])
            if not len(rows):
                continue
            dst = t
            if t.dim() > 1:
                assert rest is not None
                dst = t[(slice(None), *rest[0])]
                src = src[(slice(None), *rest[1])]
            dst.index_copy_(0, (rows - off[0]).to(t.device), src.to(t.device))
            written += src.numel()
    return written


@torch.no_grad()
def apply_own_delta(state: dict, pieces: list[DeltaPiece]) -> int:
    """apply_delta for the pieces take_delta took from a state of the same layout as `state` (the
    snapshot buffers): a piece taken by rows goes into the local piece it came from (the same offsets
    and shape), whose bounds its rows lie in by construction, so they are written without selecting
    them again. Any other piece goes through apply_delta."""
    written, rest = 0, []
    for p in pieces:
        target = _target(state, p.key)
        dst = None
        if p.rows is not None and isinstance(target, torch.Tensor):
            dst = next(
                (
                    t
                    for off, t in local_pieces(target)
                    if off == list(p.offsets) and list(t.shape) == p.extent and t.dim() == p.values.dim()
                ),
                None,
            )
        if dst is None:
            rest.append(p)
            continue
        dst.index_copy_(0, (p.rows - p.offsets[0]).to(dst.device), p.values.to(dst.device))
        written += p.values.numel()
    return written + apply_delta(state, rest)


def chain_of(manifest: dict[str, Any], sources: Sequence[CheckpointSource]) -> list[dict[str, Any]]:
    """The manifests a step needs, base first: itself for a full step, else its base and every delta up
    to it. Each link is the manifest its child names by digest, taken from a source that holds that
    one: where sources hold different checkpoints of a step (another run's, a replaced one), the
    matching copy is chosen, and the chain is refused when no source holds it."""
    chain = [manifest]
    cur = manifest
    while cur.get("kind") == "delta":
        step, parent = cur["step"], cur["parent"]
        pm, problems, others = find_manifest_of(parent, cur["parent_sha256"], sources)
        if pm is None and others:
            raise CorruptCheckpointError(
                f"step {step} is a delta of step {parent}, but step {parent}'s manifest.json in "
                f"{', '.join(others)} is another checkpoint than the one it was built on (another run's "
                "or a replaced step)"
            )
        if pm is None:
            raise CorruptCheckpointError(
                f"step {step} is a delta of step {parent}, whose manifest.json is missing or corrupt "
                f"({'; '.join(problems) or 'no source holds it'})"
            )
        chain.insert(0, pm)
        cur = pm
    if len(chain) > 1 and (
        cur["step"] != manifest["base"] or cur["manifest_sha256"] != manifest["base_sha256"]
    ):
        raise CorruptCheckpointError(
            f"step {manifest['step']}: its chain leads to step {cur['step']}, not to its base step "
            f"{manifest['base']} (manifest.json of another chain)"
        )
    return chain


Wanted = Callable[[list[str], list[int], list[int]], bool]
DeltaFiles = list[tuple[int, list[Path], dict[str, str]]]  # per delta: step, its files, file -> source


def _wanted_ranges(
    name: str, m: dict[str, Any], resolver: FileResolver, wanted: Wanted
) -> list[tuple[int, int]]:
    """The byte ranges of a delta file that a rank reads: its header, and the values and row ids of the
    entries `wanted` takes. The header comes first (the checksum blocks covering it, verified)."""
    entry = m["files"][name]
    path = resolver.peek(name, [(0, min(HEAD, entry["size"]))])  # the first checksum block
    end = header_end(path)
    if end > entry["block"]:  # the header runs past the block read so far
        path = resolver.peek(name, [(0, min(end, entry["size"]))])
    reader = DeltaReader(path)
    ranges = [(0, reader.data_at)]
    for e in reader.entries:
        if wanted(e["key"], e["offsets"], e["extent"]):
            ranges += [(reader.data_at + span[0], span[1]) for span in (e["data"], e["rows"]) if span]
    return ranges


def delta_files(
    chain: list[dict[str, Any]],
    sources: Sequence[CheckpointSource],
    verify: bool = True,
    wanted: Wanted | None = None,
) -> DeltaFiles:
    """For each delta of the chain, in order: (step, verified local paths of all its files, file ->
    source name). Rows of any old rank may fall into a rank's shards, so every file is opened; with
    `wanted` (which entries this rank applies) only the bytes of those entries are read and verified,
    and a peer sends only them (range requests of whole checksum blocks)."""
    out = []
    for m in chain[1:]:
        resolver = FileResolver(m["step"], m, sources, verify)
        paths = []
        for name in sorted(m["files"]):
            ranges = None
            if wanted is not None and "blocks" in m["files"][name]:
                ranges = _wanted_ranges(name, m, resolver, wanted)
            paths.append(resolver.path(name, ranges))
        used = {f"{m['step']}/{f}": src for f, (src, _) in resolver.resolved.items()}
        out.append((m["step"], paths, used))
    return out


def overlaps_local(state: dict) -> Wanted:
    """wanted(key, offsets, extent) for DeltaReader.pieces: does that piece overlap a piece of `state`
    this rank holds?"""

    def wanted(key: list[str], offsets: list[int], extent: list[int]) -> bool:
        target = _target(state, key)
        if not isinstance(target, torch.Tensor):
            return False
        return any(
            len(off) == len(offsets) and (not off or _overlap(off, t.shape, offsets, extent) is not None)
            for off, t in local_pieces(target)
        )

    return wanted


def apply_chain(state: dict, deltas: DeltaFiles) -> int:
    """Apply each delta's files to `state`, in chain order, reading only the pieces that overlap
    this rank's shards."""
    written = 0
    wanted = overlaps_local(state)
    for _, paths, _ in deltas:
        for path in paths:
            written += apply_delta(state, DeltaReader(path).pieces(wanted))
    return written
