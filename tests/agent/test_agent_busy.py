"""Busy time per step (on CPU + runnable) and node cgroups, with real worker processes and real cgroups.

Busy time is what tells a slow node in synchronous training: sleeping (as in a collective) is not busy,
and time a throttled node waits for its CPU quota is."""

from __future__ import annotations

import os
import time

import pytest

from elastic_rm.agent import cgroup as cg
from elastic_rm.agent.channel import AgentChannel
from elastic_rm.train.report import BusyClock

from .test_agent_channel import wait_for

needs_cgroups = pytest.mark.skipif(cg.detect() is None, reason="no writable cgroup (needs root)")


@pytest.fixture
def channel():
    ch = AgentChannel(window_s=5.0).start()
    try:
        yield ch
    finally:
        ch.close()


def test_busy_clock_counts_cpu_not_sleep():
    clock = BusyClock()
    b0 = clock.read()
    assert b0 is not None, "schedstat is readable on Linux"
    time.sleep(0.2)
    b1 = clock.read()
    t0 = time.perf_counter()
    x = 0
    while time.perf_counter() - t0 < 0.2:
        x += 1
    b2 = clock.read()
    assert 0 <= b1 - b0 < b2 - b1  # as long asleep as spinning: sleeping is not busy, spinning is


def test_a_sleeping_worker_reports_less_busy_time_than_a_computing_one(pyprocs, step_worker, tmp_path):
    # Side by side on the same machine, one channel each: whatever the load, a step spent asleep is busy
    # only for its wake-up and report, a step spent computing is busy throughout.
    with AgentChannel(window_s=60.0) as asleep, AgentChannel(window_s=60.0) as computing:
        args = ["--steps", "40", "--samples", "1"]
        (tmp_path / "a").mkdir(), (tmp_path / "c").mkdir()
        pyprocs.python(step_worker, "--out", str(tmp_path / "a"), *args, "--step-ms", "20", env=asleep.env())
        pyprocs.python(
            step_worker, "--out", str(tmp_path / "c"), *args, "--work", "200000", env=computing.env()
        )
        a = wait_for(lambda: (x := asleep.summary()) and x.steps >= 30 and x, 60, "the sleeper's reports")
        c = wait_for(lambda: (x := computing.summary()) and x.steps >= 30 and x, 60, "the computer's reports")
    assert a.p50_s >= 0.02, a  # a step lasts at least its sleep
    assert a.busy_p50_s / a.p50_s < c.busy_p50_s / c.p50_s, (a, c)


@needs_cgroups
def test_a_throttled_worker_is_busier_for_its_step_than_a_sleeping_one(pyprocs, step_worker, tmp_path):
    # At 0.2 cores the worker runs ~1/5 of each step and waits for its quota the rest, which counts as busy;
    # a worker beside it that sleeps through its step is not. Not a share of the step: a loaded machine's
    # I/O can block either for part of a step, which is busy for neither.
    group = cg.open_node_cgroup(f"test-busy-{os.getpid()}")
    try:
        group.set_cpu(0.2)
        assert group.cpu_limit() == pytest.approx(0.2)
        with AgentChannel(window_s=60.0) as throttled, AgentChannel(window_s=60.0) as asleep:
            (tmp_path / "t").mkdir(), (tmp_path / "a").mkdir()
            proc = pyprocs.python(
                step_worker,
                "--out",
                str(tmp_path / "t"),
                "--steps",
                "40",
                "--work",
                "300000",
                env=throttled.env(),
            )
            group.add(proc.pid)
            assert proc.pid in group.pids()
            args = ["--out", str(tmp_path / "a"), "--steps", "40", "--step-ms", "20"]
            pyprocs.python(step_worker, *args, env=asleep.env())
            t = wait_for(lambda: (x := throttled.summary()) and x.steps >= 20 and x, 60, "throttled steps")
            a = wait_for(lambda: (x := asleep.summary()) and x.steps >= 20 and x, 60, "sleeping steps")
        assert t.busy_p50_s / t.p50_s > a.busy_p50_s / a.p50_s, (t, a)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        group.remove()
    assert not group.cpu_dir.exists()


@needs_cgroups
def test_cgroup_limits_round_trip_and_lift(tmp_path):
    group = cg.open_node_cgroup(f"test-limits-{os.getpid()}")
    try:
        group.set_cpu(1.5)
        assert group.cpu_limit() == pytest.approx(1.5)
        group.set_cpu(None)
        assert group.cpu_limit() is None
        group.set_memory(256 << 20)
        with pytest.raises(cg.CgroupError, match="> 0 cores"):
            group.set_cpu(0)
        with pytest.raises(cg.CgroupError, match="under 16 MiB"):
            group.set_memory(1024)
    finally:
        group.remove()


def test_no_cgroup_gives_a_clear_error_and_pins_whole_cores(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_RM_CGROUP_ROOT", str(tmp_path))  # an empty directory: no controllers
    assert cg.detect() is None
    with pytest.raises(cg.CgroupError, match="no writable cgroup"):
        cg.apply_node_limits("n", cg.NodeLimits(cpu_cores=0.5))
    with pytest.raises(cg.CgroupError, match="no writable cgroup"):
        cg.apply_node_limits("n", cg.NodeLimits(memory_bytes=1 << 30))
    before = os.sched_getaffinity(0)
    pid = os.fork()
    if pid == 0:  # pin a child, never the test process
        try:
            cg.apply_node_limits("n", cg.NodeLimits(cpu_cores=1))
            os._exit(0 if len(os.sched_getaffinity(0)) == 1 else 3)
        except BaseException:
            os._exit(4)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize(
    "text, value",
    [("1048576", 1 << 20), ("512M", 512 << 20), ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("4k", 4096)],
)
def test_parse_size(text, value):
    assert cg.parse_size(text) == value


@pytest.mark.parametrize("text", ["", "lots", "-1G", "0", "nan"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        cg.parse_size(text)


@needs_cgroups
def test_monitor_reports_the_node_cgroup_not_the_machine(pyprocs):
    from elastic_rm.agent.monitor import ResourceMonitor

    group = cg.open_node_cgroup(f"test-mem-{os.getpid()}")
    try:
        group.set_memory(512 << 20)
        group.set_cpu(0.5)
        code = "import sys, time; sys.stdin.readline(); b = bytearray(200 << 20); print('ok', flush=True); "
        code += "time.sleep(60)"
        import subprocess

        proc = pyprocs.python("-c", code, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        group.add(proc.pid)
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"ok"
        mon = ResourceMonitor(interval_s=0.1, gpu_probe=None, scope=group)
        mon.set_pids([proc.pid])
        mon.sample_once()
        time.sleep(0.2)
        s = mon.sample_once()
        assert s.mem_total_bytes == 512 << 20  # the node's limit, not the machine's memory
        assert 190 << 20 <= s.mem_used_bytes <= 300 << 20  # the child's 200 MiB (+ interpreter)
        assert s.mem_available_bytes == s.mem_total_bytes - s.mem_used_bytes
        assert s.cpu_util is not None and s.cpu_util < 0.5  # a sleeping child of a 0.5-core node
        proc.kill()
        proc.wait(timeout=10)
    finally:
        group.remove()
