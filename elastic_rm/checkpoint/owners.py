"""Who uses a run's node memory, so that `erm gc` removes only what no live process owns.

A process that uses ``<root>/<run>/`` (an ermrun agent; under plain torchrun the training script, on behalf
of torchrun's agent, its parent) leaves a claim ``<root>/<run>/.owners/<pid>-<start time>``. A claim is
live while that pid is still the same process (its start time, from /proc, tells a reused pid apart).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..guard import start_time
from ..wire.channel import ENV_AGENT_DIR  # set by an ermrun agent for its workers
from .node_memory import memory_root

OWNERS = ".owners"


def claim(run_dir: Path, pid: int | None = None) -> Path | None:
    """Record ``pid`` (default: this process) as a user of ``run_dir``; the claim's path (None when the
    process is gone or the directory cannot be written: a claim is advice for `erm gc`, never fatal)."""
    pid = os.getpid() if pid is None else pid
    started = start_time(pid)
    if started is None:
        return None
    path = run_dir / OWNERS / f"{pid}-{started}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()
    except OSError:
        return None
    return path


def release(run_dir: Path, pid: int | None = None) -> None:
    """Drop ``pid``'s claim, and the run directory once nothing but dead claims is left in it."""
    pid = os.getpid() if pid is None else pid
    owners = run_dir / OWNERS
    for path in owners.glob(f"{pid}-*"):
        path.unlink(missing_ok=True)
    remove_if_unused(run_dir)


def live_owners(run_dir: Path) -> list[int]:
    """The pids whose claims on ``run_dir`` are still the same processes."""
    live = []
    owners = run_dir / OWNERS
    if not owners.is_dir():
        return live
    for path in owners.iterdir():
        pid, _, started = path.name.partition("-")
        if pid.isdigit() and start_time(int(pid)) == started:
            live.append(int(pid))
    return sorted(live)


def remove_if_unused(run_dir: Path) -> bool:
    """Remove ``run_dir`` when it holds no node's memory and no live claim."""
    try:
        entries = [p.name for p in run_dir.iterdir()]
    except OSError:
        return False
    if any(name != OWNERS for name in entries) or live_owners(run_dir):
        return False
    shutil.rmtree(run_dir, ignore_errors=True)
    return True


@dataclass(frozen=True)
class RunMemory:
    """One run's node memory on this machine, as `erm gc` sees it."""

    path: Path
    bytes: int
    owners: tuple[int, ...]  # live pids; empty: nothing uses it (a crashed or finished run)


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def scan(root: Path | None = None) -> list[RunMemory]:
    """Every run directory under the node-memory root, with its size and live owners."""
    base = Path(root or memory_root())
    if not base.is_dir():
        return []
    runs = []
    for path in sorted(base.iterdir()):
        if path.is_dir() and not path.is_symlink():
            runs.append(RunMemory(path, _size(path), tuple(live_owners(path))))
    return runs


# -- the training script's side (plain torchrun: no elastic-rm agent looks after node memory) -------------


def script_owner() -> int | None:
    """Whom a training script claims node memory for: torchrun's agent (its parent, which outlives the
    worker across restarts) or itself when run alone; None under an ermrun agent, which claims and frees
    node memory itself."""
    if os.environ.get(ENV_AGENT_DIR):
        return None
    return os.getppid() if os.environ.get("TORCHELASTIC_RUN_ID") else os.getpid()


def free_finished(run_dir: Path, node_dir: Path) -> bool:
    """A finished job's node memory under plain torchrun: this node's copies, its owner's claim, and the
    run directory once unused. False under an ermrun agent (it frees node memory when the job ends)."""
    owner = script_owner()
    if owner is None:
        return False
    shutil.rmtree(node_dir, ignore_errors=True)
    release(run_dir, owner)
    return True
