"""A restore reaches the worker's step reporter whether the script imports the reporter before or after it
restores: the checkpoint does not import the reporter (it sits below training), the reporter listens."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
from elastic_rm.checkpoint.restore import RestoreResult
from elastic_rm.checkpoint.restore_report import report_restore
{reporter_first}
report_restore(RestoreResult(step=42, position={{}}, manifest={{"world_size": 3}}, file_sources={{}}), 2)
from elastic_rm.train.report import get_reporter
print("global step", get_reporter().global_step)
"""


@pytest.mark.parametrize(  # a gloo world each (~6 s): CI keeps the reporter made after the restore
    "reporter_first", ["", pytest.param("import elastic_rm.train.report", marks=pytest.mark.slow)]
)
def test_the_reporter_counts_from_the_restored_step(reporter_first):
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_RM_AGENT_DIR"}  # plain torchrun's world
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(reporter_first=reporter_first)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[-2] == "global step 42"
