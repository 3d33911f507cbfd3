"""Folds that ran on some copies of a chain and not on others, finished before a restore.

Why: a fold is a node's own act. Each node's leader folds its memory in place, then asks its ring peer
to fold that node's replica; nothing makes the nodes (or a node and its peer) fold as one. A node
lost or stopped in between leaves the chain's newest step S in two forms: a folded base where the
fold ran, and a chain ending at S's delta where it did not (that node's own memory, or its replica on
the peer). The two forms share no step (a fold removes the chain's earlier steps where it runs), so
the ranks of the next round would find no step they all hold alike. Every copy can take the same
fold, though: the folded base's manifest names its chain by the manifests' checksums, and applying
that chain's deltas onto its base gives the same bytes wherever the chain is whole (inplace.py). So
before a restore the nodes tell each other which deltas their folded bases folded and which deltas
their chains end at; a node whose chain ends at a delta folded elsewhere gets that folded manifest
and folds the same way.

Torch-free, like the rest of the fold: the caller gathers what the nodes hold.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .inplace import FoldRefused, fold_chain, recover_fold
from .manifest import MANIFEST, CorruptCheckpointError, parse_manifest, step_dirname
from .retention import read_links

log = logging.getLogger(__name__)


def held_folds(dirs: list[Path]) -> tuple[dict[str, str], list[str]]:
    """What these directories hold, for the nodes to compare: their folded bases, as {the digest of the
    delta each folded: its manifest's text} (each manifest checked), and the digests of the deltas their
    chains end at (what a folded base elsewhere may have folded). A fold that a crash interrupted here is
    finished (or dropped) first."""
    offers: dict[str, str] = {}
    tops: list[str] = []
    for directory in dirs:
        recover_fold(directory)
        links = read_links(directory)
        if links and (top := links[max(links)]).kind == "delta":
            tops.append(top.sha)
        for step, link in links.items():
            if link.kind != "full":
                continue
            path = directory / step_dirname(step) / MANIFEST
            try:
                body = path.read_bytes()
                folded = parse_manifest(body, str(path)).get("folded")
                if isinstance(folded, dict) and isinstance(folded.get("top_sha256"), str):
                    offers[folded["top_sha256"]] = body.decode()
            except (OSError, UnicodeDecodeError, CorruptCheckpointError):
                continue  # the restore reports a bad manifest; it offers nothing here
    return offers, tops


def finish_split_folds(dirs: list[Path], offers: dict[str, str]) -> list[tuple[Path, int]]:
    """Fold each of `dirs` whose newest step is a delta that one of `offers` (folded manifests, by the
    digest of the delta each folded, from every node) folded elsewhere; returns the (directory, step)
    folds done. A directory that does not hold that whole chain is left as it is (fold_chain refuses
    before touching anything)."""
    done: list[tuple[Path, int]] = []
    for directory in dirs if offers else []:  # none: no fold was split (the usual restore)
        links = read_links(directory)
        if not links:
            continue
        top = links[max(links)]
        body = offers.get(top.sha) if top.kind == "delta" else None
        if body is None:
            continue
        try:
            fold_chain(directory, body.encode())
        except FoldRefused as e:
            log.info("restore: %s keeps its chain of step %d: %s", directory, top.step, e)
            continue
        except (CorruptCheckpointError, OSError, ValueError) as e:
            log.warning("restore: the fold of step %d in %s failed: %s", top.step, directory, e)
            recover_fold(directory)
            continue
        log.warning(
            "restore: step %d in %s was still a chain where other copies had folded it: folded the same "
            "way (a node or its peer stopped between the two folds)",
            top.step,
            directory,
        )
        done.append((directory, top.step))
    return done


__all__ = ["finish_split_folds", "held_folds"]
