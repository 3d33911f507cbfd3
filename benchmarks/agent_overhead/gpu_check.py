"""GPU path of the monitor against a real NVIDIA GPU (run where one is lent; CI never runs it).

    python -m benchmarks.agent_overhead.gpu_check

Idle for 3 s, then 8 GiB allocated on cuda:0 and a bf16 matmul loop for 6 s, then freed. Prints the
monitor's GPU samples and checks: utilisation under load > 0.5 and above idle, memory used up by at
least 7 GiB during the allocation, temperature and total memory reported. Exit 1 on a failed check.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from elastic_rm.agent.gpu import NvmlProbe
from elastic_rm.agent.monitor import ResourceMonitor

GIB = 1 << 30


def main() -> int:
    probe = NvmlProbe()
    if probe.device_count == 0 or not torch.cuda.is_available():
        print("no GPU visible to NVML or torch; nothing to check")
        return 1
    mon = ResourceMonitor(interval_s=0.5, window_s=2.0, gpu_probe=probe)
    phases: dict[str, list] = {}

    def watch(name: str, seconds: float, work=None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if work is not None:
                work()
            else:
                time.sleep(0.05)
        phases[name] = [g.__dict__ for g in mon.latest().gpus]
        print(name, json.dumps(phases[name]), flush=True)

    with mon:
        watch("idle", 3.0)
        block = torch.empty(8 * GIB, dtype=torch.uint8, device="cuda:0")
        block.fill_(1)
        torch.cuda.synchronize()
        mats = [torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16) for _ in range(2)]

        def matmul() -> None:
            for _ in range(20):
                torch.matmul(mats[0], mats[0], out=mats[1])
            torch.cuda.synchronize()

        watch("load", 6.0, matmul)
        summary = mon.summary()
        del block
        mats.clear()
        torch.cuda.empty_cache()
        watch("freed", 2.0)
    probe.close()
    idle, load = phases["idle"][0], phases["load"][0]
    checks = {
        "util under load > 0.5": (load["util"] or 0) > 0.5,
        "util under load > idle": (load["util"] or 0) > (idle["util"] or 0),
        "memory +7 GiB": load["mem_used_bytes"] - idle["mem_used_bytes"] >= 7 * GIB,
        "temperature known": load["temp_c"] is not None,
        "total memory > 100 GiB (H200)": load["mem_total_bytes"] > 100 * GIB,
        "summary has the GPU": summary is not None and len(summary.gpus) >= 1,
    }
    print(json.dumps({"summary_gpus": [g.__dict__ for g in summary.gpus] if summary else None}))
    for name, ok in checks.items():
        print(("PASS " if ok else "FAIL ") + name)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
