"""Node and worker resource sampling (psutil, optional GPUs) on a background thread, with a window summary.

The agent publishes a summary (mean/max/last over ``window_s``) at most once a second, so the sampler keeps
a short window of samples instead of pushing each one. One sample reads /proc/stat, /proc/meminfo and two
/proc files per worker, so 1 Hz sampling costs a small fraction of a core (docs/benchmarks.md,
agent_overhead).

Node CPU utilisation is the busy fraction of all cores between two samples (psutil's formula: everything but
idle and iowait). It is read from /proc/stat, i.e. the host's view: inside a CPU-limited container it is
the host's utilisation. Per-worker CPU is the worker process's own user+system time (its threads included,
its child processes, e.g. data-loader workers, not) per wall second: 1.0 is one busy core.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from elastic_rm.agent.gpu import THROTTLE_REASON_BITS, GpuProbe, GpuSample, make_gpu_probe
from elastic_rm.background import Background

from .cgroup import NodeCgroup, current_node_cgroup

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
DEFAULT_WINDOW_S = 10.0


@dataclass(frozen=True)
class WorkerSample:
    pid: int
    rss_bytes: int
    cpu_util: float | None  # cores busy since the previous sample; None on the first sample of a pid


@dataclass(frozen=True)
class NodeSample:
    t: float  # unix time
    mono: float  # monotonic time, for windowing
    cpu_util: float | None  # 0..1 of all cores; None on the very first sample
    mem_used_bytes: int
    mem_available_bytes: int
    mem_total_bytes: int
    workers: tuple[WorkerSample, ...] = ()
    gpus: tuple[GpuSample, ...] = ()
    mem_node_bytes: int | None = None  # the node's own: its cgroup's, else the agent's + workers' RSS


@dataclass(frozen=True)
class WorkerSummary:
    pid: int
    rss_bytes: int  # last
    cpu_util: float  # mean over the window, cores (1.0 = one busy core)


@dataclass(frozen=True)
class GpuSummary:
    index: int
    util: float | None  # mean over the window, 0..1; None when the device never reported it
    mem_used_bytes: int  # last
    mem_total_bytes: int
    temp_c: float | None  # last
    throttled: bool  # a slowdown reason was active in any sample of the window
    throttle_reasons: tuple[str, ...]  # union over the window


@dataclass(frozen=True)
class ResourceSummary:
    """What the agent publishes about its node: aggregates over the last ``window_s`` seconds."""

    t: float  # unix time of the newest sample
    samples: int
    cpu_util_mean: float
    cpu_util_max: float
    cpu_util_last: float
    mem_used_bytes: int  # last
    mem_available_bytes: int
    mem_total_bytes: int
    workers: tuple[WorkerSummary, ...]
    gpus: tuple[GpuSummary, ...]
    mem_node_bytes: int | None = None  # last; the node's own memory (NodeSample)


class _Tracked:
    __slots__ = ("proc", "cpu_s", "mono")

    def __init__(self, proc: psutil.Process, cpu_s: float, mono: float) -> None:
        self.proc, self.cpu_s, self.mono = proc, cpu_s, mono


def _cpu_busy_total(ct: object) -> tuple[float, float]:
    """(busy, total) seconds summed over all cores, as psutil.cpu_percent computes them on Linux."""
    total = sum(ct)  # type: ignore[arg-type]
    total -= getattr(ct, "guest", 0.0) + getattr(ct, "guest_nice", 0.0)  # already counted in user/nice
    busy = total - ct.idle - getattr(ct, "iowait", 0.0)  # type: ignore[attr-defined]
    return busy, total


class ResourceMonitor:
    """Samples the node (and the given worker pids, and GPUs) every ``interval_s`` seconds.

    Use :meth:`start`/:meth:`stop` (or ``with``) for the background thread, :meth:`set_pids` whenever the
    workers change, and :meth:`summary` to read the window aggregate. ``gpu_probe="auto"`` probes NVML
    (and closes the probe on stop); ``None`` monitors no GPUs; a :class:`GpuProbe` is used as given.

    ``scope``: when the agent runs in a node cgroup (``ermrun --cpu-limit/--memory-limit``, several nodes
    on one machine), memory is that group's working set against its limit and CPU is the workers' use
    against the group's quota, so each node reports its own pressure, not the machine's. ``"auto"`` finds
    the group this process is in (elastic_rm.agent.cgroup); None always reports the whole machine.
    """

    def __init__(
        self,
        interval_s: float = DEFAULT_INTERVAL_S,
        window_s: float = DEFAULT_WINDOW_S,
        gpu_probe: GpuProbe | str | None = "auto",
        scope: NodeCgroup | str | None = "auto",
    ) -> None:
        # bounded: Event.wait(inf) raised OverflowError and the sampling thread died after one sample
        if not isinstance(interval_s, int | float) or not 0 < interval_s < threading.TIMEOUT_MAX:
            raise ValueError(
                f"monitor interval must be a positive number of seconds (finite), got {interval_s!r} "
                "(the default is 1 s; pass e.g. 0.5 or 2)"
            )
        if not isinstance(window_s, int | float) or not 0 < window_s < math.inf:  # inf: never trimmed
            raise ValueError(
                f"monitor window must be a positive number of seconds (finite), got {window_s!r}"
            )
        self.interval_s = float(interval_s)
        self.window_s = float(window_s)
        self._own_probe = gpu_probe == "auto"
        if gpu_probe == "auto":
            self._gpu: GpuProbe | None = make_gpu_probe()
        elif isinstance(gpu_probe, str):
            raise ValueError(f"gpu_probe must be 'auto', None or a GpuProbe, got {gpu_probe!r}")
        else:
            self._gpu = gpu_probe
        self._lock = threading.Lock()
        self._samples: deque[NodeSample] = deque()
        self._tracked: dict[int, _Tracked] = {}
        self._last_cpu: tuple[float, float] | None = None
        self._sampler = Background(self._run, "elastic-rm-monitor")
        self._errors = 0
        self._scope = current_node_cgroup() if scope == "auto" else scope
        if isinstance(self._scope, str):
            raise ValueError(f"scope must be 'auto', None or a NodeCgroup, got {scope!r}")

    # ---- workers -------------------------------------------------------------------------------------
    def set_pids(self, pids: Iterable[int]) -> None:
        """Watch exactly these worker pids from now on (reads their CPU baseline at once)."""
        wanted = {int(p) for p in pids}
        with self._lock:
            for pid in list(self._tracked):
                if pid not in wanted:
                    del self._tracked[pid]
            for pid in wanted - self._tracked.keys():
                try:
                    proc = psutil.Process(pid)
                    ct = proc.cpu_times()
                except psutil.Error:
                    continue  # already gone: nothing to watch
                self._tracked[pid] = _Tracked(proc, ct.user + ct.system, time.monotonic())

    # ---- sampling ------------------------------------------------------------------------------------
    def sample_once(self) -> NodeSample:
        """Take one sample now, add it to the window and return it."""
        mono, now = time.monotonic(), time.time()
        busy, total = _cpu_busy_total(psutil.cpu_times())
        cpu_util: float | None = None
        if self._last_cpu is not None:
            d_total = total - self._last_cpu[1]
            if d_total > 0:
                cpu_util = min(max((busy - self._last_cpu[0]) / d_total, 0.0), 1.0)
        self._last_cpu = (busy, total)
        vm = psutil.virtual_memory()
        with self._lock:
            tracked = list(self._tracked.items())
        workers: list[WorkerSample] = []
        gone: list[int] = []
        for pid, tr in tracked:
            try:
                with tr.proc.oneshot():
                    ct = tr.proc.cpu_times()
                    rss = tr.proc.memory_info().rss
            except psutil.Error:
                gone.append(pid)
                continue
            t_mono = time.monotonic()
            cpu_s = ct.user + ct.system
            dt = t_mono - tr.mono
            util = max(cpu_s - tr.cpu_s, 0.0) / dt if dt > 0 else None
            tr.cpu_s, tr.mono = cpu_s, t_mono
            workers.append(WorkerSample(pid=pid, rss_bytes=int(rss), cpu_util=util))
        gpus = tuple(self._gpu.sample()) if self._gpu is not None else ()
        used, available, total = int(vm.used), int(vm.available), int(vm.total)
        node_bytes = self._own_rss() + sum(w.rss_bytes for w in workers)
        if self._scope is not None:
            cpu_util, (used, available, total), scoped = self._scoped(workers, cpu_util, vm)
            node_bytes = used if scoped else node_bytes
        sample = NodeSample(
            t=now,
            mono=mono,
            cpu_util=cpu_util,
            mem_used_bytes=used,
            mem_available_bytes=available,
            mem_total_bytes=total,
            workers=tuple(workers),
            gpus=gpus,
            mem_node_bytes=node_bytes,
        )
        with self._lock:
            for pid in gone:
                self._tracked.pop(pid, None)
            self._samples.append(sample)
            horizon = mono - self.window_s
            while len(self._samples) > 1 and self._samples[0].mono < horizon:
                self._samples.popleft()
        return sample

    @staticmethod
    def _own_rss() -> int:
        """The agent's own resident memory (the monitor runs in the agent)."""
        try:
            return int(psutil.Process().memory_info().rss)
        except psutil.Error:
            return 0

    def _scoped(self, workers, host_cpu, vm) -> tuple[float | None, tuple[int, int, int], bool]:
        """CPU and memory of the node's cgroup (see ``scope``); the machine's where a read fails (False)."""
        scope = self._scope
        assert scope is not None
        try:
            used, limit = scope.memory_usage()
            cores = scope.cpu_limit() or float(psutil.cpu_count() or 1)
        except (OSError, ValueError):
            return host_cpu, (int(vm.used), int(vm.available), int(vm.total)), False
        total = min(limit, int(vm.total)) if limit else int(vm.total)
        available = max(total - used, 0) if limit else int(vm.available)
        known = [w.cpu_util for w in workers if w.cpu_util is not None]
        cpu = min(sum(known) / cores, 1.0) if known else (None if workers else 0.0)
        return cpu, (used, available, total), True

    def latest(self) -> NodeSample | None:
        with self._lock:
            return self._samples[-1] if self._samples else None

    def gpu_inventory(self) -> tuple[int, str]:
        """(GPU count, model) of this node as its probe sees them, for the node record (planner capacity)."""
        probe = self._gpu
        if probe is None:
            return 0, ""
        count = int(getattr(probe, "device_count", 0) or 0)
        model = probe.model() if count and hasattr(probe, "model") else ""
        return count, model

    def summary(self) -> ResourceSummary | None:
        """Mean/max/last over the window; None until a CPU utilisation is known (two samples)."""
        with self._lock:
            horizon = time.monotonic() - self.window_s
            window = [s for s in self._samples if s.mono >= horizon] or list(self._samples)[-1:]
        cpu = [s.cpu_util for s in window if s.cpu_util is not None]
        if not cpu:
            return None
        last = window[-1]
        workers = []
        for w in last.workers:
            utils = [
                x.cpu_util for s in window for x in s.workers if x.pid == w.pid and x.cpu_util is not None
            ]
            workers.append(
                WorkerSummary(
                    pid=w.pid, rss_bytes=w.rss_bytes, cpu_util=sum(utils) / len(utils) if utils else 0.0
                )
            )
        return ResourceSummary(
            t=last.t,
            samples=len(window),
            cpu_util_mean=sum(cpu) / len(cpu),
            cpu_util_max=max(cpu),
            cpu_util_last=cpu[-1],
            mem_used_bytes=last.mem_used_bytes,
            mem_available_bytes=last.mem_available_bytes,
            mem_total_bytes=last.mem_total_bytes,
            workers=tuple(workers),
            gpus=tuple(_gpu_summary(g, window) for g in last.gpus),
            mem_node_bytes=last.mem_node_bytes,
        )

    # ---- thread --------------------------------------------------------------------------------------
    def start(self) -> ResourceMonitor:
        """Start the sampling thread (takes a first sample at once)."""
        if self._sampler.running:
            raise RuntimeError("ResourceMonitor already started; call stop() first")
        if self._own_probe and self._gpu is None:  # restarted after stop() closed the probe
            self._gpu = make_gpu_probe()
        self._sampler.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (waits at most ``timeout_s``) and close the GPU probe if the monitor made it."""
        if not self._sampler.stop(timeout_s):
            log.warning("the resource monitor is still sampling (a /proc read hangs?)")
        if self._own_probe and self._gpu is not None:
            self._gpu.close()
            self._gpu = None

    def __enter__(self) -> ResourceMonitor:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self, stopping: threading.Event) -> None:
        deadline = time.monotonic()
        while not stopping.is_set():
            try:
                self.sample_once()
            except Exception:  # a sampling failure must not kill monitoring; logged, not hidden
                self._errors += 1
                if self._errors <= 3:
                    log.exception("resource sample failed (%d so far)", self._errors)
            deadline += self.interval_s
            delay = deadline - time.monotonic()
            if delay < 0:  # fell behind (suspended, overloaded): do not burst to catch up
                deadline, delay = time.monotonic(), 0.0
            stopping.wait(delay)


def _gpu_summary(last: GpuSample, window: list[NodeSample]) -> GpuSummary:
    same = [g for s in window for g in s.gpus if g.index == last.index]
    utils = [g.util for g in same if g.util is not None]
    reasons = {r for g in same for r in g.throttle_reasons}
    order = [name for _, name in THROTTLE_REASON_BITS]
    ordered = tuple(sorted(reasons, key=lambda r: (order.index(r) if r in order else len(order), r)))
    return GpuSummary(
        index=last.index,
        util=sum(utils) / len(utils) if utils else None,
        mem_used_bytes=last.mem_used_bytes,
        mem_total_bytes=last.mem_total_bytes,
        temp_c=last.temp_c,
        throttled=any(g.throttled for g in same),
        throttle_reasons=ordered,
    )
