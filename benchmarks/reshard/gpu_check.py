"""The GPU check of the reshard path, as one prepared script for a machine with a GPU (CI never runs it):

    python -m benchmarks.reshard.gpu_check [--gib 1.0]          # on the GPU machine
    python -m benchmarks.reshard.gpu_check --device cpu --gib 0.05   # the same logic here, without CUDA

1. World 2 on CPU (gloo): ~GiB of embeddings + fused Adagrad state filled with values that are an exact
   function of (row, column), flash-saved into node memory.
2. World 1 on cuda:0 (NCCL): the same tables planned for one GPU; the CPU world's checkpoint restored into
   it and every element checked on the device (bit-exact or not); then the flash save of the GPU state
   (step pause, device -> host snapshot; background write) and a restore timed, next to the
   device -> host copy floor of the same bytes.

Writes benchmarks/results/reshard-gpu.json (reshard-gpu-cpu.json with --device cpu). Exit 1 when an
element differs. Needs torch with CUDA, fbgemm-gpu (CUDA) and torchrec: the `gpu` extra.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from benchmarks.common import RESULTS, fmt, write_result
from benchmarks.reshard.__main__ import launch, new_spec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0, help="embeddings + optimizer state, GiB (default 1)")
    ap.add_argument("--tables", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="the world-1 phase's device")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--results-dir", default=RESULTS, help="where the JSON goes (default benchmarks/results)")
    args = ap.parse_args()
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible to torch: run this on the GPU machine (or --device cpu)")
            return 1
    spec = new_spec(args.gib, args.tables, args.dim, "erm-reshard-gpu-")
    work, shm, rows = Path(spec["workdir"]), Path(spec["shm"]), spec["rows"]
    spec["phases"] = [
        {"world": 2, "save": True, "node": "n0"},  # CPU, gloo, one node: fill, flash save
        {
            "world": 1,
            "restore": True,
            "save": True,
            "node": "n0",  # the same machine: its memory holds every file
            "device": args.device,
            "backend": "nccl" if args.device == "cuda" else "gloo",
        },
    ]
    print(
        f"gpu check: {args.tables} tables x {rows} rows x {args.dim} dim, CPU world 2 -> {args.device} "
        "world 1"
    )
    try:
        per_rank = launch(spec, 2, args.timeout)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    phases = {r["phase"]: r for r in per_rank[0]}
    cpu, dev = phases[0], phases[1]
    result = {
        "device": args.device,
        "state_gib": dev["state_bytes"] / 2**30,
        "plan_world_1": dev["plan"],
        "restore_from_cpu_world_2_s": dev["flash_restore_s"],
        "restore_dcp_load_s": dev["flash_dcp_load_s"],
        "restore_verify_s": dev["flash_verify_s"],
        "elements_differing": dev["flash_restore_bad"],
        "flash_pause_s": dev["flash_warm_pause_s"],
        "flash_pause_cold_s": dev["flash_cold_pause_s"],
        "flash_background_s": dev["flash_warm_background_s"],
        "device_to_host_floor_s": dev["memcpy_s"],
        "cpu_world_2_flash_pause_s": cpu["flash_warm_pause_s"],
    }
    name = "reshard-gpu" if args.device == "cuda" else "reshard-gpu-cpu"
    write_result(name, {"config": spec, "result": result}, args.results_dir)
    ok = dev["flash_restore_bad"] == 0
    print(
        f"restore CPU world 2 -> {args.device} world 1: {fmt(result['restore_from_cpu_world_2_s'])}, "
        f"{'bit-exact' if ok else str(int(dev['flash_restore_bad'])) + ' elements differ'}; "
        f"flash save on {args.device}: pause {fmt(result['flash_pause_s'])} (cold "
        f"{fmt(result['flash_pause_cold_s'])}), "
        f"background {fmt(result['flash_background_s'])}; device->host floor "
        f"{fmt(result['device_to_host_floor_s'])}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
