"""Who uses a run's node memory, so that `erm gc` removes only what no live process owns.

A process that uses ``<root>/<run>/`` (an ermrun agent; under plain torchrun the training script, on behalf
of torchrun's agent, its parent) leaves a claim ``<root>/<run>/.owners/<pid>-<start time>``. A claim is
live while that pid is still the same process (its start time, from /proc, tells a reused pid apart).
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from ..guard import start_time
from ..wire.channel import ENV_AGENT_DIR  # set by an ermrun agent for its workers
from .manifest import MANIFEST
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
    try:
        claims = list((run_dir / OWNERS).iterdir())
    except OSError:  # none made, or removed meanwhile: its last owner released the run (release)
        return live
    for path in claims:
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
    """One directory under the node-memory root, as `erm gc` sees it."""

    path: Path
    bytes: int  # 0 for a directory that is not node memory (gc does not walk it)
    owners: tuple[int, ...]  # live pids; empty: nothing uses it (a crashed or finished run)
    node_memory: bool = True  # False: elastic-rm did not make it; gc never removes it


def _size(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


# What a node directory (<run>/<node>/, and a peer's <node>/replicas/<src>/) may hold: its steps
# (manifest.py: step-N, written as step-N.tmp, replaced through step-N.old), a fold's hidden base and
# journal (fold_lock.py), the replicas it keeps for peers (store.py) and a restore's fetch cache (flash.py).
_NODE_ENTRY = re.compile(r"^(?:(?:step|fold)-\d+(?:\.tmp|\.old)?|fold\.json|replicas|fetch)$")
_STEP_DIR = re.compile(r"^(?:step|fold)-\d+(?:\.old)?$")  # a step with its manifest.json: elastic-rm's mark
_UNFINISHED = re.compile(r"^step-\d{8,}\.tmp$")  # a step cut short (flash's own zero-padded name)
_CLAIM = re.compile(r"^\d+-\d+$")  # <pid>-<start time>, as claim() names it


def _entries(path: Path) -> list[os.DirEntry] | None:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return None


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _node_marks(node_dir: Path) -> int | None:
    """How many of elastic-rm's marks a node directory holds (a step directory with its manifest.json,
    an unfinished step, a peer's replica of either); None when it holds anything elastic-rm does not
    write there, or is not a plain directory."""
    entries = _entries(node_dir)
    if entries is None:
        return None
    marks = 0
    for e in entries:
        if not _NODE_ENTRY.match(e.name):
            return None
        if e.name == "replicas":
            if not _is_dir(e):
                return None
            for src in _entries(Path(e.path)) or []:
                held = _node_marks(Path(src.path)) if _is_dir(src) else None
                if held is None:
                    return None
                marks += held
        elif _STEP_DIR.match(e.name):
            if _is_dir(e) and os.path.isfile(os.path.join(e.path, MANIFEST)):
                marks += 1
        elif _UNFINISHED.match(e.name) and _is_dir(e):
            marks += 1
    return marks


def _claimed(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds claim()'s directory with at least one claim (live or not) in it, and
    nothing else."""
    owners = run_dir / OWNERS
    if owners.is_symlink() or not owners.is_dir():
        return False
    entries = _entries(owners)
    return bool(entries) and all(_CLAIM.match(e.name) for e in entries)


def is_node_memory(run_dir: Path) -> bool:
    """Whether elastic-rm made ``run_dir`` (``<root>/<run>/``): it holds a claim (``.owners/<pid>-<start
    time>``), or else it has the layout of a run's node memory that lost its claims (a crash, a run killed
    before it claimed it, a signalled agent): nothing but node directories (and an empty ``.owners``),
    which hold nothing but what a flash checkpoint writes there, and at least one step directory with its
    manifest.json (or an unfinished ``step-NNNNNNNN.tmp``). Anything else (a user's directory under a
    mistaken --root) is not node memory, and `erm gc` never removes it."""
    if run_dir.is_symlink() or not run_dir.is_dir():
        return False
    if _claimed(run_dir):
        return True
    entries = _entries(run_dir)
    if not entries:
        return False
    marks = 0
    for e in entries:
        if not _is_dir(e):
            return False
        if e.name == OWNERS:
            if _entries(Path(e.path)):  # not claims only (those count above)
                return False
            continue
        held = _node_marks(Path(e.path))
        if held is None:
            return False
        marks += held
    return marks > 0


def scan(root: Path | None = None) -> list[RunMemory]:
    """Every directory under the node-memory root: a run's node memory with its size and live owners, or
    (``node_memory=False``) a directory elastic-rm did not make, neither walked nor ever removed."""
    base = Path(root or memory_root())
    if not base.is_dir():
        return []
    runs = []
    for path in sorted(base.iterdir()):
        if not path.is_dir() or path.is_symlink():
            continue
        if is_node_memory(path):
            runs.append(RunMemory(path, _size(path), tuple(live_owners(path))))
        else:
            runs.append(RunMemory(path, 0, (), node_memory=False))
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
