"""A node's CPU share and memory limit, enforced by a cgroup of its own.

Why: several agents on one machine are several *nodes* only if each has its own resources. A node's
agent moves itself into ``elastic-rm/<node>`` before it starts workers (they inherit it), so a CPU quota
makes that node really slow (a straggler the planner must find from measured step times, not from a
simulated input) and a memory limit makes its memory pressure real. Operators use the same to slow a node
down on purpose (``erm demo``, the straggler test) or to keep a job off a shared host's last cores.

Both cgroup v2 (unified; the ``cpu`` and ``memory`` controllers enabled for children) and v1 (the ``cpu``
and ``memory`` hierarchies) are supported; the root must be writable (root, or a delegated subtree named
with ``ELASTIC_RM_CGROUP_ROOT``). Where neither is, :func:`open_node_cgroup` raises :class:`CgroupError`
saying so; the documented fallback for a CPU share is ``--cpu-limit`` with a whole number of cores, which
pins the node to that many cores with ``sched_setaffinity`` (no quota, no memory limit).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PERIOD_US = 100_000  # CFS period for quotas: 100 ms (the kernel default)
GROUP = "elastic-rm"


class CgroupError(RuntimeError):
    """No usable cgroup here, or a limit could not be set; the message says what to do."""


@dataclass(frozen=True)
class Layout:
    """Where the cpu and memory controllers live: one directory each (the same one on v2)."""

    version: int
    cpu: Path
    memory: Path


def _own_paths(proc_cgroup: str) -> dict[str, str]:
    """Controller -> this process's cgroup path, from /proc/self/cgroup ('' key: the v2 path)."""
    paths = {}
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def detect(root: str | os.PathLike | None = None) -> Layout | None:
    """The writable cgroup layout with cpu and memory controllers, or None.

    Node groups go *under this process's own cgroup* (a container's or a session's), never above it, so
    the limits a machine's operator set still apply to them."""
    base = Path(root or os.environ.get("ELASTIC_RM_CGROUP_ROOT") or "/sys/fs/cgroup")
    try:
        own = (
            _own_paths(Path("/proc/self/cgroup").read_text())
            if root is None and base == Path("/sys/fs/cgroup")
            else {}
        )
    except OSError:
        own = {}
    controllers = base / "cgroup.controllers"
    if controllers.is_file():  # v2 mounted at base
        here = base / own.get("", "/").lstrip("/")
        have = (
            (here / "cgroup.controllers").read_text().split()
            if (here / "cgroup.controllers").is_file()
            else []
        )
        if {"cpu", "memory"} <= set(have) and os.access(here, os.W_OK):
            return Layout(2, here, here)
        return None
    cpu = base / "cpu" / own.get("cpu", "/").lstrip("/")
    mem = base / "memory" / own.get("memory", "/").lstrip("/")
    if (cpu / "cpu.cfs_quota_us").is_file() and (mem / "memory.limit_in_bytes").is_file():
        if os.access(cpu, os.W_OK) and os.access(mem, os.W_OK):
            return Layout(1, cpu, mem)
    return None


class NodeCgroup:
    """``elastic-rm/<name>`` under each controller. Create with :func:`open_node_cgroup`."""

    def __init__(self, layout: Layout, name: str):
        self.layout, self.name = layout, name
        self.cpu_dir = layout.cpu / GROUP / name
        self.memory_dir = layout.memory / GROUP / name

    def _dirs(self) -> list[Path]:
        return [self.cpu_dir] if self.layout.version == 2 else [self.cpu_dir, self.memory_dir]

    def _write(self, path: Path, value: str) -> None:
        try:
            path.write_text(value)
        except OSError as exc:
            raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from None

    def add(self, pid: int) -> None:
        """Move a process (and the children it starts from now on) into this node's group."""
        for d in self._dirs():
            self._write(d / "cgroup.procs", str(pid))

    def set_cpu(self, cores: float | None) -> None:
        """A CPU quota of ``cores`` (0.25 = a quarter of one core per period); None lifts it."""
        _check_cpu(cores)
        quota = -1 if cores is None else max(1000, int(cores * PERIOD_US))
        if self.layout.version == 2:
            self._write(self.cpu_dir / "cpu.max", f"{'max' if quota < 0 else quota} {PERIOD_US}")
        else:
            self._write(self.cpu_dir / "cpu.cfs_period_us", str(PERIOD_US))
            self._write(self.cpu_dir / "cpu.cfs_quota_us", str(quota))

    def cpu_limit(self) -> float | None:
        if self.layout.version == 2:
            quota, period = (self.cpu_dir / "cpu.max").read_text().split()
            return None if quota == "max" else int(quota) / int(period)
        quota = int((self.cpu_dir / "cpu.cfs_quota_us").read_text())
        period = int((self.cpu_dir / "cpu.cfs_period_us").read_text())
        return None if quota < 0 else quota / period

    def set_memory(self, limit_bytes: int | None) -> None:
        """A hard memory limit (the kernel OOM-kills inside the group beyond it); None lifts it."""
        _check_memory(limit_bytes)
        if self.layout.version == 2:
            self._write(self.memory_dir / "memory.max", "max" if limit_bytes is None else str(limit_bytes))
        else:
            self._write(
                self.memory_dir / "memory.limit_in_bytes", "-1" if limit_bytes is None else str(limit_bytes)
            )

    def memory_usage(self) -> tuple[int, int | None]:
        """(working set in bytes, limit or None): usage minus inactive file cache, as container runtimes
        count it, so a node's page cache does not look like memory pressure."""
        if self.layout.version == 2:
            usage = int((self.memory_dir / "memory.current").read_text())
            raw_limit = (self.memory_dir / "memory.max").read_text().strip()
            limit = None if raw_limit == "max" else int(raw_limit)
            inactive_key = "inactive_file"
        else:
            usage = int((self.memory_dir / "memory.usage_in_bytes").read_text())
            limit = int((self.memory_dir / "memory.limit_in_bytes").read_text())
            limit = None if limit >= 1 << 60 else limit
            inactive_key = "total_inactive_file"
        stat = dict(
            line.split() for line in (self.memory_dir / "memory.stat").read_text().splitlines() if " " in line
        )
        return max(usage - int(stat.get(inactive_key, 0)), 0), limit

    def pids(self) -> list[int]:
        text = (self.cpu_dir / "cgroup.procs").read_text() if self.cpu_dir.exists() else ""
        return [int(p) for p in text.split()]

    def remove(self) -> None:
        """Move any process left back to the parent and delete the group (idempotent)."""
        for d in self._dirs():
            if not d.exists():
                continue
            parent_procs = d.parent.parent / "cgroup.procs"  # the group we were in (above elastic-rm/)
            for pid in (d / "cgroup.procs").read_text().split():
                try:
                    parent_procs.write_text(pid)
                except OSError:
                    pass  # it exited meanwhile
            try:
                d.rmdir()
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    log.warning("could not remove cgroup %s: %s", d, exc.strerror)


def _check_cpu(cores: float | None) -> None:
    # NaN and infinity too: int(inf * PERIOD_US) raised an OverflowError (a traceback from ermrun)
    if cores is not None and not 0 < cores < math.inf:
        raise CgroupError(f"a CPU limit must be a finite number > 0 cores, got {cores!r}")


def _check_memory(limit_bytes: int | None) -> None:
    if limit_bytes is not None and limit_bytes < 16 << 20:
        raise CgroupError(f"a memory limit under 16 MiB cannot run a worker: {limit_bytes} bytes")


def open_node_cgroup(name: str, root: str | os.PathLike | None = None) -> NodeCgroup:
    """Create (or reopen) the node's group. Raises :class:`CgroupError` where cgroups are not usable."""
    layout = detect(root)
    if layout is None:
        raise CgroupError(
            "no writable cgroup with the cpu and memory controllers (need root, or a delegated cgroup v2 "
            "subtree given as ELASTIC_RM_CGROUP_ROOT); for a CPU share without cgroups pass --cpu-limit "
            "as a whole number of cores (the node is pinned to that many cores)"
        )
    group = NodeCgroup(layout, name)
    for d in group._dirs():
        if layout.version == 2 and not d.parent.exists():
            d.parent.mkdir(exist_ok=True)
            try:
                _enable_v2_controllers(layout.cpu, d.parent)
            except CgroupError:
                # not left behind without its controllers: the next run would find it, skip enabling
                # them, and fail to write its limits instead of saying this (or pinning whole cores)
                with contextlib.suppress(OSError):
                    d.parent.rmdir()
                raise
        d.mkdir(parents=True, exist_ok=True)
    return group


def _enable_v2_controllers(root: Path, group_parent: Path) -> None:
    for d in (root, group_parent):
        try:
            (d / "cgroup.subtree_control").write_text("+cpu +memory")
        except OSError as exc:
            raise CgroupError(
                f"cannot enable the cpu and memory controllers in {d}: {exc.strerror}"
            ) from None


def pin_to_cores(cores: int, pid: int = 0) -> tuple[int, ...]:
    """The fallback without cgroups: restrict ``pid`` (0 = this process, inherited by children) to the
    first ``cores`` of the CPUs it may use now. Returns the CPUs chosen."""
    allowed = sorted(os.sched_getaffinity(pid))
    if not 1 <= cores <= len(allowed):
        raise CgroupError(f"cannot pin to {cores} core(s): this process may use {len(allowed)}")
    chosen = tuple(allowed[:cores])
    os.sched_setaffinity(pid, chosen)
    return chosen


@dataclass(frozen=True)
class NodeLimits:
    """What ``ermrun --cpu-limit/--memory-limit`` asked for."""

    cpu_cores: float | None = None
    memory_bytes: int | None = None

    @property
    def any(self) -> bool:
        return self.cpu_cores is not None or self.memory_bytes is not None


def apply_node_limits(name: str, limits: NodeLimits, pid: int | None = None) -> NodeCgroup | None:
    """Put ``pid`` (default: this process) under the limits. With cgroups: a group of its own (returned;
    the caller removes it at exit). Without: a whole-core CPU limit falls back to CPU pinning; anything
    else is a CgroupError naming what to do."""
    pid = os.getpid() if pid is None else pid
    if not limits.any:
        return None
    _check_cpu(limits.cpu_cores)  # before a group exists: a bad value must not leave one behind
    _check_memory(limits.memory_bytes)
    try:
        group = open_node_cgroup(name)
    except CgroupError:
        cores = limits.cpu_cores
        if limits.memory_bytes is None and cores is not None and float(cores).is_integer():
            chosen = pin_to_cores(int(cores), pid)
            log.warning("no writable cgroup: node %s pinned to CPU(s) %s instead of a quota", name, chosen)
            return None
        raise
    try:
        group.set_cpu(limits.cpu_cores)
        group.set_memory(limits.memory_bytes)
        group.add(pid)
    except BaseException:  # a limit the kernel refused: the caller gets no group to remove, so remove it
        group.remove()
        raise
    return group


def parse_size(text: str) -> int:
    """'512M', '2G', '1.5GiB', '1048576' -> bytes (binary units)."""
    units = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    num, unit = (s[:-1], s[-1]) if s and s[-1] in "kmgt" else (s, "")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(
            f"invalid size {text!r}: use bytes or a number with K, M, G or T (e.g. 2G)"
        ) from None
    if not 0 < value < math.inf:  # NaN too; infinity raised an OverflowError from int()
        raise ValueError(f"invalid size {text!r}: must be a positive, finite number")
    return int(value * units[unit])


def current_node_cgroup() -> NodeCgroup | None:
    """The node group this process runs in (``.../elastic-rm/<name>``), or None: how the agent's monitor
    learns to report the node's own CPU share and memory instead of the whole machine's."""
    try:
        own = _own_paths(Path("/proc/self/cgroup").read_text())
    except OSError:
        return None
    path = own.get("memory") or own.get("", "")
    parts = path.strip("/").split("/")
    if len(parts) < 2 or parts[-2] != GROUP:
        return None
    base = Path("/sys/fs/cgroup")
    if (base / "cgroup.controllers").is_file():
        parent = base / "/".join(parts[:-2])
        layout = Layout(2, parent, parent)
    else:
        cpu_parts = own.get("cpu", "/").strip("/").split("/")
        cpu_parent = base / "cpu" / "/".join(cpu_parts[:-2]) if cpu_parts[-2:-1] == [GROUP] else None
        if cpu_parent is None:
            return None
        layout = Layout(1, cpu_parent, base / "memory" / "/".join(parts[:-2]))
    return NodeCgroup(layout, parts[-1])
