"""The prepared GPU check of the reshard path (benchmarks/reshard/gpu_check.py) runs here with the world-1
phase on CPU: the same processes, checkpoint and element checks as on a GPU, so a change that breaks the
script is caught without one (the CUDA phase itself needs a GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO


# 11 s; a benchmark's script; CI keeps the reshard paths it calls (tests/train/test_train_reshard.py)
@pytest.mark.slow
def test_gpu_check_logic_on_cpu(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.reshard.gpu_check",
            "--device",
            "cpu",
            "--gib",
            "0.02",
            "--results-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "bit-exact" in out.stdout
    result = json.loads((tmp_path / "reshard-gpu-cpu.json").read_text())["result"]
    assert result["elements_differing"] == 0 and result["state_gib"] > 0.015
    assert result["restore_from_cpu_world_2_s"] > 0 and result["flash_pause_s"] > 0
