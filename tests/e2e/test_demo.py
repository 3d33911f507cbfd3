"""`erm demo` (what `make demo` runs) completes its scenario and leaves nothing running."""

from __future__ import annotations

import json
import os
import subprocess

import psutil
import pytest

from elastic_rm.agent import cgroup
from tests.conftest import BIN


@pytest.mark.slow
def test_demo_scales_up_survives_a_kill_and_cleans_up(tmp_path):
    before = {p.pid for p in psutil.process_iter()}
    result = subprocess.run(
        [
            os.path.join(BIN, "erm"),
            "demo",
            "--no-live",
            "--workdir",
            str(tmp_path),
            "--hold",
            "4",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert json.loads((tmp_path / "demo.json").read_text())["wall_s"] == summary["wall_s"]
    assert {"2", "3"} <= set(summary["throughput"])
    reasons = [r["reason"] for r in summary["rounds"]]
    assert any(r.startswith("scale up 2 -> 3") for r in reasons), reasons  # the planner admitted node-c
    assert any("lost" in r for r in reasons), reasons
    if cgroup.detect() is not None:
        assert any(r.startswith("straggler(s) node-b replaced by ") for r in reasons), reasons
    assert summary["restores"], "the survivors must restore from the flash checkpoint"
    assert summary["checks"] and all(c["ok"] for c in summary["checks"]), summary["checks"]
    assert (tmp_path / "timeline.png").stat().st_size > 10_000
    layout = cgroup.detect()
    if layout is not None:  # the SIGKILLed node could not remove its node cgroup: the demo did
        run_id = next(
            w for e in summary["events"] for w in e["text"].replace(";", " ").split() if w.startswith("demo-")
        )
        groups = layout.cpu / cgroup.GROUP
        assert not [p for p in (groups.iterdir() if groups.is_dir() else []) if p.name.startswith(run_id)]
    # the demo's nodes and workers name its workdir (--progress-dir) on their command line: other jobs on a
    # shared machine do not count
    leftovers = [
        p
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.info["pid"] not in before and any(str(tmp_path) in c for c in (p.info["cmdline"] or []))
    ]
    assert leftovers == []
