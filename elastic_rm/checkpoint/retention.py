"""Which checkpoint steps a directory keeps when steps form chains: a full step (the base), then delta
steps whose manifest names their ``parent`` and ``base`` with the manifests' own checksums
(``parent_sha256``, ``base_sha256``). A delta is worth keeping only with every step it leads back to.

Why apart from the writers: node memory, a peer's replicas and the durable copy prune by the same rule,
and the agent's checkpoint server (which must not import torch) applies it too. Only manifests are read;
a manifest without ``kind`` is a full step. A restore also drops, and never reads, the steps of a
timeline it abandoned (timeline.py).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import timeline
from .fold_lock import JOURNAL, fold_lock, hidden_dirname
from .manifest import (
    MANIFEST,
    CorruptCheckpointError,
    chain_value,
    committed_steps,
    parse_manifest,
    step_dirname,
)


@dataclass(frozen=True)
class Link:
    """What retention needs of one committed step's manifest."""

    step: int
    sha: str
    kind: str  # "full" or "delta"
    parent: int | None = None
    parent_sha: str | None = None
    base: int | None = None
    base_sha: str | None = None


def link_of(manifest: dict[str, Any]) -> Link:
    """The chain fields of a parsed manifest (a manifest without ``kind`` is a full step)."""
    step, sha = int(manifest["step"]), str(manifest.get("manifest_sha256", ""))
    if manifest.get("kind", "full") != "delta":
        return Link(step, sha, "full")
    try:
        return Link(
            step,
            sha,
            "delta",
            int(manifest["parent"]),
            str(manifest["parent_sha256"]),
            int(manifest["base"]),
            str(manifest["base_sha256"]),
        )
    except (KeyError, TypeError, ValueError):
        return Link(step, sha, "delta")  # names no parent: it can never be restored


def read_links(directory: Path) -> dict[int, Link]:
    """The committed steps of `directory` (a manifest that reads as JSON with a step) by step."""
    links = {}
    root = str(directory)
    for step in committed_steps(directory):
        try:
            link = chain_value(os.path.join(root, step_dirname(step)), link_of)
        except (OSError, ValueError, KeyError, TypeError, RecursionError):
            continue  # uncommitted or unreadable: restore reports it, retention skips it
        if link.step == step:
            links[step] = link
    return links


def chain(links: dict[int, Link], step: int) -> list[int] | None:
    """The steps `step` needs, base first, or None when a link is missing or names another checkpoint
    than the one present (another run's step, a replaced one)."""
    out: list[int] = []
    cur = links.get(step)
    while cur is not None and cur.kind == "delta":
        out.append(cur.step)
        parent = links.get(cur.parent) if cur.parent is not None and cur.parent < cur.step else None
        if parent is None or parent.sha != cur.parent_sha:
            return None
        cur = parent
    if cur is None:
        return None
    out.append(cur.step)
    top = links[step]
    if top.kind == "delta" and (cur.step != top.base or cur.sha != top.base_sha):
        return None
    return out[::-1]


def steps_to_keep(links: dict[int, Link], keep: int) -> set[int]:
    """The newest `keep` restorable steps and every step their chains need. With full steps only this
    is the newest `keep` steps; a chain of deltas keeps its base and all its deltas."""
    kept: set[int] = set()
    points = 0
    for step in sorted(links, reverse=True):
        if points >= max(1, keep):
            break
        steps = chain(links, step)
        if steps is not None:
            kept.update(steps)
            points += 1
    return kept


def prune_chains(directory: Path, keep: int) -> list[int]:
    """Remove the step directories older than the newest kept step that no kept chain needs, and stale
    ``.tmp`` directories older than it; returns the steps removed. Steps newer than every restorable
    one stay (a writer may be completing their chain)."""
    links = read_links(directory)
    kept = steps_to_keep(links, keep)
    if not kept:
        return []
    newest = max(kept)
    removed = [s for s in committed_steps(directory) if s < newest and s not in kept]
    for s in removed:
        shutil.rmtree(directory / step_dirname(s), ignore_errors=True)
    for p in directory.iterdir():
        m = re.match(r"^step-(\d{8,})\.tmp", p.name)
        if m and int(m.group(1)) < newest:
            shutil.rmtree(p, ignore_errors=True)
    return removed


def drop_newer_than(directory: Path, step: int, current: timeline.Key | None = None) -> list[int]:
    """Remove the committed steps newer than `step` (and, given the `current` timeline, those of an
    abandoned one: timeline.py), the ``.tmp`` directories of unfinished saves after it and a pending
    fold whose top is newer; returns the steps removed. After a restore of `step` the steps after it
    are saved again under the same numbers: an old one kept would be counted as the newest, or read
    with a new one. Holds the directory's fold lock: a fold running there (the checkpoint server
    folding a replica) ends first, and its step is then dropped."""
    if not directory.is_dir():
        return []
    with fold_lock(directory):
        _drop_pending_fold(directory, step)
        off = set(abandoned_steps(directory, current)) if current is not None else set()
        removed = [s for s in committed_steps(directory) if s > step or s in off]
        for s in removed:
            shutil.rmtree(directory / step_dirname(s), ignore_errors=True)
        for p in directory.iterdir():
            m = re.match(r"^step-(\d{8,})\.tmp", p.name)
            if m and int(m.group(1)) > step:
                shutil.rmtree(p, ignore_errors=True)
    return removed


def _raw_timeline(fields: dict[str, Any]) -> str:
    return json.dumps(fields.get("timeline"), sort_keys=True)  # immutable, for chain_value's memo


def timeline_field(step_dir: str | Path) -> Any:
    """The ``timeline`` field of a step's manifest (None when absent), read unverified through the
    manifest cache: one read per version of the file. Raises OSError or ValueError like reading it."""
    return json.loads(chain_value(os.fspath(step_dir), _raw_timeline))


def _timelines(directory: Path) -> Iterable[tuple[int, Any]]:
    """(step, its manifest's timeline field) for the committed steps whose manifest reads (unverified)."""
    for step in committed_steps(directory):
        try:
            yield step, timeline_field(directory / step_dirname(step))
        except (OSError, ValueError, RecursionError):
            continue


def newest_timeline(directories: Iterable[Path]) -> timeline.Key | None:
    """The newest timeline of the committed steps in `directories`, taken only from a manifest that
    passes its checksum and checks (a torn or flipped one must not make every real step look
    abandoned); None when none does."""
    by_key: dict[timeline.Key, list[Path]] = {}
    for directory in directories:
        for step, raw in _timelines(directory):
            if timeline.check_field(raw) is None:
                key = timeline.key_of({"timeline": raw})
                by_key.setdefault(key, []).append(Path(directory) / step_dirname(step) / MANIFEST)
    for key in sorted(by_key, reverse=True):
        for path in by_key[key]:
            try:
                parse_manifest(path.read_bytes(), str(path))
            except (OSError, CorruptCheckpointError):
                continue
            return key
    return None


def abandoned_steps(directory: Path, current: timeline.Key) -> list[int]:
    """The committed steps of `directory` whose manifest names a timeline off `current`'s history (read
    unverified: such a step is never restored; one whose manifest does not read is left to the
    pruning above)."""
    return [
        step
        for step, raw in _timelines(directory)
        if timeline.check_field(raw) is None
        and not timeline.is_live(current, {"timeline": raw, "step": step})
    ]


def _drop_pending_fold(directory: Path, step: int) -> None:
    """A fold pending in `directory` (a crash interrupted it) whose top is newer than `step` goes, with
    its hidden base: finished, it would bring back a step of the old timeline, and its base, partly
    rewritten, holds no step that could be kept. Hidden bases no readable journal names go too; an
    unreadable journal is left to recover_fold."""
    path = directory / JOURNAL
    try:
        journal = json.loads(path.read_bytes())
    except FileNotFoundError:
        journal = None
    except (OSError, ValueError, RecursionError):
        return
    pending = None
    if isinstance(journal, dict) and isinstance(journal.get("base"), int):
        top = journal.get("top")
        if isinstance(top, int) and top <= step:
            pending = hidden_dirname(journal["base"])
        else:
            path.unlink(missing_ok=True)
    elif journal is not None:
        return
    for p in directory.iterdir():
        if re.fullmatch(r"fold-\d{8,}", p.name) and p.name != pending:
            shutil.rmtree(p, ignore_errors=True)


def missing_from(links: dict[int, Link], present: dict[int, Link], step: int) -> list[int]:
    """The steps of `step`'s chain (in `links`) that `present` lacks or holds as another checkpoint,
    base first: what a copy (a durable directory, a peer's replicas) needs so that `step` restores
    there. Raises ValueError when `step`'s own chain is incomplete."""
    steps = chain(links, step)
    if steps is None:
        raise ValueError(f"step {step}: its chain of checkpoints is incomplete here; it cannot be copied")
    return [s for s in steps if s not in present or present[s].sha != links[s].sha]
