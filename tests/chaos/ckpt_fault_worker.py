"""tests/train's worker with a fault point: at the chosen point of a flash checkpoint save or restore, the
chosen rank writes a marker file and then waits to be SIGKILLed by the test (it never continues).

    CHAOS_FAULT=<point> CHAOS_FAULT_RANK=<rank> CHAOS_FAULT_STEP=<step> CHAOS_DIR=<dir> CHAOS_DURABLE=<dir> \
        python ckpt_fault_worker.py SPEC.json RANK NPROCS

Points (the patch lives in this test process only; the product code has no fault hook):
  publish_memory  before this node's step directory in memory is published (data files and manifest are
                  written into step-N.tmp; the rename that makes them count has not happened)
  persist_copy    halfway through copying a file into the durable step-N.tmp (a torn file)
  restore_load    during a restore: DCP has read this rank's tensors, the model is not yet updated
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))

import erm_train_worker  # noqa: E402

import elastic_rm.checkpoint.flash as checkpoint  # noqa: E402
import elastic_rm.checkpoint.restore as restore  # noqa: E402


def _hang(point: str) -> None:
    marker = Path(os.environ["CHAOS_DIR"]) / f"fault-{point}"
    marker.write_text(str(os.getpid()))
    for _ in range(3600):  # bounded: the test kills us long before
        time.sleep(1)
    os._exit(3)


def _durable(path: Path) -> bool:
    return str(Path(path).resolve()).startswith(str(Path(os.environ["CHAOS_DURABLE"]).resolve()))


def install(point: str, step: int) -> None:
    wanted = f"step-{step:08d}"
    if point == "publish_memory":
        real_publish = checkpoint.publish_dir

        def publish_dir(tmp: Path, final: Path, sync: bool) -> None:
            if final.name == wanted and not _durable(final):
                _hang(point)
            real_publish(tmp, final, sync)

        checkpoint.publish_dir = publish_dir
    elif point == "persist_copy":
        real_copy = checkpoint.copy_file

        def copy_file(src: Path, dst: Path, sync: bool) -> None:
            if dst.parent.name == wanted + ".tmp" and _durable(dst):
                data = Path(src).read_bytes()
                Path(dst).write_bytes(data[: len(data) // 2])  # torn
                _hang(point)
            real_copy(src, dst, sync)

        checkpoint.copy_file = copy_file
    elif point == "restore_load":
        real_load = restore.load_app_state

        def load_app_state(*args, **kwargs):
            _hang(point)
            return real_load(*args, **kwargs)

        restore.load_app_state = load_app_state
    else:
        raise SystemExit(f"unknown CHAOS_FAULT {point!r}")


if __name__ == "__main__":
    point = os.environ.get("CHAOS_FAULT", "")
    if point and int(sys.argv[2]) == int(os.environ.get("CHAOS_FAULT_RANK", "-1")):
        install(point, int(os.environ.get("CHAOS_FAULT_STEP", "0")))
    erm_train_worker.main()
