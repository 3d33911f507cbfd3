"""A rank process for tests/test_bench_ranks.py: writes its pid, then does what its spec says for its
rank ("ok": a result file; "fail": a message on stderr and exit 3; "hang": sleep until killed; "child":
start a process that sleeps until killed and writes its pid, then hang)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    work = Path(spec["workdir"])
    (work / f"pid-{rank}").write_text(str(os.getpid()))
    action = spec["actions"][rank]
    if action == "fail":
        print(f"rank {rank}: failing on purpose", file=sys.stderr, flush=True)
        sys.exit(3)
    if action == "child":
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        (work / f"child-{rank}").write_text(str(child.pid))
    if action in ("hang", "child"):
        for _ in range(600):  # bounded: the helper kills it long before
            time.sleep(0.1)
    (work / f"result-{rank}.json").write_text(json.dumps({"rank": rank}))


if __name__ == "__main__":
    main()
