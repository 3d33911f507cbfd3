"""Runs `erm demo` in a fresh work directory and copies its figures (demo.json) into
benchmarks/results/demo.json, where README's demo figures are checked. The demo itself writes only into its
work directory. Arguments after the options go to `erm demo` (e.g. ``--hold 8``).

    .venv/bin/python -m benchmarks.demo
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import keep_run_result

ERM = Path(sys.executable).parent / "erm"


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    work = tempfile.mkdtemp(prefix="erm-demo-bench-")
    done = subprocess.run([str(ERM), "demo", "--no-live", "--workdir", work, *extra])
    return keep_run_result(done.returncode, work, "demo", "erm demo")


if __name__ == "__main__":
    sys.exit(main())
