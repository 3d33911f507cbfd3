"""Where a node keeps its in-memory checkpoint copies. Light on purpose: the agent imports it to clean up
without loading torchrec."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

MEMORY_ROOT = Path("/dev/shm") / "elastic-rm"
ENV_MEMORY_ROOT = "ELASTIC_RM_MEMORY_ROOT"  # another node-memory root (a tmpfs), for every process of a node


def memory_root() -> Path:
    """Where node memory lives: $ELASTIC_RM_MEMORY_ROOT, else /dev/shm/elastic-rm."""
    return Path(os.environ.get(ENV_MEMORY_ROOT) or MEMORY_ROOT)


def run_memory_dir(run_id: str, root: Path | None = None) -> Path:
    return Path(root or memory_root()) / run_id


def remove_node_memory(run_id: str, node_id: str, root: Path | None = None) -> bool:
    """Free a node's memory copies of a finished run (and the run directory once it is empty)."""
    run_dir = run_memory_dir(run_id, root)
    node_dir = run_dir / node_id
    if not node_dir.is_dir():
        return False
    shutil.rmtree(node_dir, ignore_errors=True)
    try:
        run_dir.rmdir()  # only when no other node on this machine keeps copies
    except OSError:
        pass
    log.info("removed the in-memory checkpoints of node %s of run %s", node_id, run_id)
    return True


def memory_dirs(node_dir: Path) -> list[Path]:
    """A node's memory directory and the replica directories it holds for its peers (``replicas/<src>/``,
    sorted); none when the node holds no memory."""
    if not node_dir.is_dir():
        return []
    rep = node_dir / "replicas"
    return [node_dir] + (sorted(p for p in rep.iterdir() if p.is_dir()) if rep.is_dir() else [])


def held_bytes(directory: Path) -> int:
    """Bytes of the files under `directory` (a node's memory directory: its steps, the replicas it keeps
    for peers, unfinished temporary directories): what the node's checkpoints hold in its memory now."""
    total = 0
    stack = [Path(directory)]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:  # absent, or removed meanwhile (a prune)
            continue
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    stack.append(Path(e.path))
                elif e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
            except OSError:
                continue
    return total
