"""Resource monitor against real processes: a spinning worker, an idle one, one that allocates 1 GiB."""

from __future__ import annotations

import math
import subprocess
import threading
import time

import psutil
import pytest

from elastic_rm.agent.gpu import GpuSample
from elastic_rm.agent.monitor import ResourceMonitor

GIB = 1 << 30
SPIN = "while True: pass"
IDLE = "import time; time.sleep(60)"
ALLOC = (
    "import sys, time\n"
    "sys.stdin.readline()\n"
    "b = b'x' * (1 << 30)  # filled, so every page is resident\n"
    "print('allocated', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize("bad", [0, -1, 0.0, math.nan, "1"])
def test_interval_must_be_positive(bad):
    with pytest.raises(ValueError, match="interval must be a positive number"):
        ResourceMonitor(interval_s=bad, gpu_probe=None)


def _schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds waiting for one) of a process, from the kernel's scheduler stats."""
    run_ns, wait_ns, _ = open(f"/proc/{pid}/schedstat").read().split()
    return int(run_ns) / 1e9, int(wait_ns) / 1e9


def test_busy_worker_uses_a_core_and_idle_one_none(pyprocs):
    busy, idle = pyprocs.python("-c", SPIN), pyprocs.python("-c", IDLE)
    mon = ResourceMonitor(interval_s=1.0, window_s=10.0, gpu_probe=None)
    time.sleep(0.3)  # both interpreters up
    mon.set_pids([busy.pid, idle.pid])
    # the kernel's account of the spinner read just before and just after each of the monitor's samples:
    # the monitor's window lies between the inner and the outer readings, however late this thread runs
    before = [(_schedstat(busy.pid)[0], time.monotonic())]
    mon.sample_once()
    before.append((_schedstat(busy.pid)[0], time.monotonic()))
    time.sleep(1.0)
    after = [(_schedstat(busy.pid)[0], time.monotonic())]
    sample = mon.sample_once()
    after.append((_schedstat(busy.pid)[0], time.monotonic()))
    util = {w.pid: w.cpu_util for w in sample.workers}
    ran_min, ran_max = after[0][0] - before[1][0], after[1][0] - before[0][0]
    wall_min, wall_max = after[0][1] - before[1][1], after[1][1] - before[0][1]
    # The monitor agrees with the kernel's own account of the spinner's CPU time (a whole core only when
    # the machine had one free), up to the 10 ms ticks the process's CPU times are counted in
    tick = 2 * 0.01 / wall_min
    assert ran_min / wall_max - tick <= util[busy.pid] <= ran_max / wall_min + tick, (util, before, after)
    assert util[idle.pid] < 0.05, util  # a sleeping process uses no CPU, however loaded the machine
    n_cores = psutil.cpu_count()
    assert sample.cpu_util is not None and sample.cpu_util >= 0.9 * util[busy.pid] / n_cores, sample
    s = mon.summary()
    assert s is not None and s.cpu_util_max >= s.cpu_util_mean and s.cpu_util_last == sample.cpu_util


def test_memory_grows_when_a_worker_allocates_1gib(pyprocs):
    proc = pyprocs.python("-c", ALLOC, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    mon = ResourceMonitor(interval_s=1.0, gpu_probe=None)
    mon.set_pids([proc.pid])
    time.sleep(0.3)  # interpreter started
    before = mon.sample_once()
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == b"allocated"
    after = mon.sample_once()
    rss = {w.pid: w.rss_bytes for w in before.workers}, {w.pid: w.rss_bytes for w in after.workers}
    assert rss[1][proc.pid] - rss[0][proc.pid] >= 0.95 * GIB, rss
    s = mon.summary()
    assert s is not None and s.workers[0].rss_bytes >= GIB and s.mem_used_bytes == after.mem_used_bytes
    proc.kill()
    proc.wait(timeout=5)
    freed = mon.sample_once()
    # The machine's memory moves with everything else that runs on it; the node's own (the agent's and its
    # workers' resident memory) moves with the worker: up by its GiB, and down by it when the worker dies.
    assert after.mem_node_bytes - before.mem_node_bytes >= 0.95 * GIB, (before, after)
    assert after.mem_node_bytes - freed.mem_node_bytes >= 0.95 * GIB, (after, freed)
    assert after.mem_total_bytes == before.mem_total_bytes > after.mem_used_bytes >= rss[1][proc.pid]


def test_a_worker_that_exits_drops_out(pyprocs):
    p = pyprocs.python("-c", IDLE)
    mon = ResourceMonitor(interval_s=1.0, gpu_probe=None)
    mon.set_pids([p.pid])
    assert [w.pid for w in mon.sample_once().workers] == [p.pid]
    p.kill()
    p.wait(timeout=5)
    assert mon.sample_once().workers == ()
    mon.set_pids([])
    assert mon.sample_once().workers == ()


def test_thread_lifecycle_is_bounded():
    mon = ResourceMonitor(interval_s=0.05, window_s=0.2, gpu_probe=None)
    before = set(threading.enumerate())
    mon.start()
    (sampler,) = set(threading.enumerate()) - before
    with pytest.raises(RuntimeError, match="already started"):
        mon.start()
    time.sleep(0.3)
    mon.stop()
    assert not sampler.is_alive()  # stopped, so no sample comes after
    kept = [s.mono for s in mon._samples]
    assert kept and all(t >= kept[-1] - 0.2 for t in kept), kept  # the window's 0.2 s, not everything


class _TwoGpus:
    """A GpuProbe (the protocol, not NVML) whose second GPU is throttled in one sample only."""

    def __init__(self) -> None:
        self.n = 0

    def sample(self) -> list[GpuSample]:
        self.n += 1
        hot = ("sw_thermal_slowdown",) if self.n == 2 else ()
        return [
            GpuSample(0, 0.2 * self.n, 1 << 30, 80 << 30, 50.0),
            GpuSample(1, None, 2 << 30, 80 << 30, 70.0 + self.n, hot),
        ]

    def close(self) -> None:
        pass


def test_gpu_samples_are_aggregated_over_the_window():
    mon = ResourceMonitor(interval_s=1.0, window_s=60, gpu_probe=_TwoGpus())
    for _ in range(3):
        time.sleep(0.05)  # /proc/stat moves in 10 ms ticks: CPU utilisation needs time between samples
        mon.sample_once()
    s = mon.summary()
    assert s is not None
    g0, g1 = s.gpus
    assert g0.util == pytest.approx(0.4) and not g0.throttled  # mean of 0.2, 0.4, 0.6
    assert g1.util is None and g1.temp_c == 73.0  # unknown stays unknown; temperature is the last
    assert g1.throttled and g1.throttle_reasons == ("sw_thermal_slowdown",)  # seen once in the window
