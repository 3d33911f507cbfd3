"""Bad ``--cpu-limit`` / ``--memory-limit`` values are clear errors (CgroupError / ValueError, which ermrun
prints as one line) and leave no node cgroup behind: an infinite size or CPU share raised an
OverflowError (a traceback), and a limit refused after the group was made (under 16 MiB, or by the
kernel) left ``elastic-rm/<run>.<node>`` in every controller."""

from __future__ import annotations

import math
import os

import pytest

from elastic_rm.agent import cgroup as cg


@pytest.fixture
def fake_v1(tmp_path, monkeypatch):
    """A writable tree that detect() takes for cgroup v1 (files, not a kernel: nothing is enforced)."""
    (tmp_path / "cpu").mkdir()
    (tmp_path / "memory").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1")
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(str(1 << 62))
    monkeypatch.setenv("ELASTIC_RM_CGROUP_ROOT", str(tmp_path))
    assert cg.detect() is not None
    return tmp_path


def _groups(root) -> list[str]:
    return [str(p.relative_to(root)) for p in root.glob("*/elastic-rm/*")]


@pytest.mark.parametrize("text", ["inf", "infinity", "1e400", "-inf"])
def test_an_infinite_size_is_a_clear_error(text):
    with pytest.raises(ValueError, match="invalid size"):
        cg.parse_size(text)


@pytest.mark.parametrize(
    "limits, message",
    [
        (cg.NodeLimits(memory_bytes=8 << 20), "under 16 MiB"),
        (cg.NodeLimits(cpu_cores=1.0, memory_bytes=0), "under 16 MiB"),
        (cg.NodeLimits(cpu_cores=math.inf), "finite number > 0 cores"),
        (cg.NodeLimits(cpu_cores=math.nan), "finite number > 0 cores"),
        (cg.NodeLimits(cpu_cores=-1.0), "finite number > 0 cores"),
    ],
)
def test_a_bad_limit_makes_no_group(fake_v1, limits, message):
    with pytest.raises(cg.CgroupError, match=message):
        cg.apply_node_limits("run.node", limits, pid=os.getpid())
    assert _groups(fake_v1) == []


def test_a_good_limit_still_makes_its_group(fake_v1, monkeypatch):
    monkeypatch.setattr(cg.NodeCgroup, "add", lambda self, pid: None)  # a fake tree takes no process
    group = cg.apply_node_limits("run.node", cg.NodeLimits(cpu_cores=0.5, memory_bytes=1 << 30))
    assert group is not None and group.cpu_limit() == pytest.approx(0.5)
    assert sorted(_groups(fake_v1)) == ["cpu/elastic-rm/run.node", "memory/elastic-rm/run.node"]


@pytest.mark.skipif(cg.detect() is None, reason="no writable cgroup (needs root)")
def test_a_limit_the_kernel_refuses_removes_the_group():
    name = f"test-refused-{os.getpid()}"
    with pytest.raises(cg.CgroupError, match="cannot write"):
        cg.apply_node_limits(name, cg.NodeLimits(cpu_cores=1e300), pid=os.getpid())  # quota out of range
    group = cg.NodeCgroup(cg.detect(), name)
    try:
        assert not group.cpu_dir.exists() and not group.memory_dir.exists()
        assert os.getpid() not in group.pids()
    finally:
        group.remove()


def test_v2_controllers_that_cannot_be_enabled_leave_no_group_parent(tmp_path, monkeypatch):
    # cgroup v2 refuses "+cpu +memory" in a group that holds processes (EBUSY); here the write fails
    # because cgroup.subtree_control is a directory. The elastic-rm/ it made was left without its
    # controllers: the next run skipped enabling them and failed on its limits instead of saying this.
    (tmp_path / "cgroup.controllers").write_text("cpu memory\n")
    (tmp_path / "cgroup.subtree_control").mkdir()
    monkeypatch.setenv("ELASTIC_RM_CGROUP_ROOT", str(tmp_path))
    for _ in range(2):  # the same clear error each time
        with pytest.raises(cg.CgroupError, match="cannot enable the cpu and memory controllers"):
            cg.open_node_cgroup("run.node")
        assert not (tmp_path / cg.GROUP).exists()
