"""Runs `erm demo` in a fresh work directory and copies its figures (demo.json) into
benchmarks/results/demo.json, where README's demo figures are checked. The demo itself writes only into its
work directory. Arguments after the options go to `erm demo` (e.g. ``--hold 8``).

    .venv/bin/python -m benchmarks.demo
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import copy_result

ERM = Path(sys.executable).parent / "erm"


def main(argv: list[str] | None = None) -> int:
    extra = sys.argv[1:] if argv is None else argv
    work = tempfile.mkdtemp(prefix="erm-demo-bench-")
    done = subprocess.run([str(ERM), "demo", "--no-live", "--workdir", work, *extra])
    figures = Path(work) / "demo.json"
    if done.returncode != 0 or not figures.is_file():
        print(
            f"erm demo failed (exit {done.returncode}): benchmarks/results/demo.json left as it was; "
            f"its logs are in {work}",
            file=sys.stderr,
        )
        return done.returncode or 1
    print("wrote", copy_result(figures, "demo"))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
