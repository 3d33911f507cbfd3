"""Runs the soak (tests/chaos/test_soak.py, 30 minutes by default; ERM_SOAK_MINUTES shortens it) and copies
its figures (soak.json) into benchmarks/results/soak.json, where docs/guarantees.md's soak figures are
checked. The soak itself writes only into its work directory ($ERM_SOAK_OUT).

    .venv/bin/python -m benchmarks.soak
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from benchmarks.common import REPO, keep_run_result


def main() -> int:
    work = tempfile.mkdtemp(prefix="erm-soak-bench-")
    env = {**os.environ, "ERM_SOAK": "1", "ERM_SOAK_OUT": work}
    test = "tests/chaos/test_soak.py"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "", test], cwd=REPO, env=env)
    return keep_run_result(done.returncode, work, "soak", "the soak")


if __name__ == "__main__":
    sys.exit(main())
