"""Discovery scripts as real processes: their output, their failures, their hangs; and the diff."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from elastic_rm.launch.discovery import DiscoveryError, diff_hosts, run_discovery
from elastic_rm.launch.hostfile import parse_hosts


def test_output_is_read_in_the_hostfile_format(tmp_path):
    hosts = run_discovery("printf 'h1 addr=127.0.0.1\\nh2 slots=2 gpu=t4\\n'", timeout_s=30)
    assert [(h.name, h.addr, h.slots, h.labels) for h in hosts] == [
        ("h1", "127.0.0.1", None, {}),
        ("h2", "h2", 2, {"gpu": "t4"}),
    ]


def test_a_failing_script_is_an_error_with_its_exit_status_and_stderr():
    with pytest.raises(DiscoveryError, match=r"exited with 3: inventory service down"):
        run_discovery("echo 'inventory service down' >&2; exit 3", timeout_s=30)


def test_bad_output_names_the_line():
    with pytest.raises(DiscoveryError, match="output, line 2: slots=x"):
        run_discovery("printf 'h1\\nh2 slots=x\\n'", timeout_s=30)


def test_a_hanging_script_is_killed_with_what_it_started(tmp_path):
    pid_file = tmp_path / "pid"
    with pytest.raises(DiscoveryError, match=r"did not finish within 1s \(--discovery-timeout\)"):
        run_discovery(f"sleep 300 & echo $! > {pid_file}; wait", timeout_s=1)
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while psutil.pid_exists(child) and psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the script's child survived the timeout"
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{child}") or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_diff_names_added_removed_and_changed_hosts():
    old = parse_hosts("a\nb slots=1\nc\n", "old")
    new = parse_hosts("b slots=2\nc\nd\n", "new")
    d = diff_hosts(old, new)
    assert [h.name for h in d.added] == ["d"]
    assert [h.name for h in d.removed] == ["a"]
    assert [(h.name, h.slots) for h in d.changed] == [("b", 2)]
