"""Warm spares benchmark: part b's planned rounds (benchmarks.recovery --part b) with spares.

Variants, each a planned round of the example TorchRec DLRM, one worker per node, downtime from rank 0's
last step before the round to the first step of every rank after it:
- ``ermrun+spares/...``: a script that does not opt in to rounds in place; every node's new worker
  starts from a warm spare (``--spares on --spare-preload`` the example's heavy modules);
- ``ermrun-inplace+spares/...``: the example with ``--in-place``; the staying nodes keep their workers,
  the joining node's worker starts from a spare (pre-started while it waits in the rendezvous);
- ``ermrun-new-processes/...``: the non-opting script with ``--spares off`` (every worker a new process);
- ``torchrun/scale-up`` and ``torchrun/disk-restart``: torchrun's own scale-up and its restart from a
  disk checkpoint (the baselines of benchmarks.recovery part b).
Rounds: a scale-up 2 -> 3 and, where cgroups are writable, a straggler swap. ``--contended``: the same
rounds while another process keeps one core busy (a spinning Python loop), for both launchers. While
each trial runs, the resident memory of its waiting spares is sampled (they are found by their command
line, which names the trial's progress directory). Writes benchmarks/results/recovery-spares.json (or
recovery-spares-contended.json) with the load average before and after every trial, and prints ratios.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading

import psutil

from benchmarks.common import fmt, summarize, write_result
from benchmarks.recovery.__main__ import planned_trial

# torch.distributed.optim: TorchRec's apply_optimizer_in_backward imports it on first use, and its import
# compiles TorchScript (about 1 s); preloaded, a joining worker does not pay it in the round
PRELOAD = "torch,torchrec,torchrec.models.dlrm,torch.distributed.optim,elastic_rm.train"
ON = ("--spares", "on", "--spare-preload", PRELOAD)
OFF = ("--spares", "off")
VARIANTS = {  # name -> (the kind of benchmarks.recovery part b, extra ermrun flags)
    "ermrun+spares/scale-up": ("ermrun/scale-up", ON),
    "ermrun-inplace+spares/scale-up": ("ermrun-inplace/scale-up", ON),
    "ermrun-new-processes/scale-up": ("ermrun/scale-up", OFF),
    "ermrun+spares/straggler-swap": ("ermrun/straggler-swap", ON),
    "ermrun-inplace+spares/straggler-swap": ("ermrun-inplace/straggler-swap", ON),
    "ermrun-new-processes/straggler-swap": ("ermrun/straggler-swap", OFF),
    "torchrun/scale-up": ("torchrun/scale-up", ()),
    "torchrun/disk-restart": ("torchrun/disk-restart", ()),
}
TRIAL_DIRS = os.path.join(tempfile.gettempdir(), "erm-planned-")  # planned_trial's work directories
TARGET_S = 1.0  # the target median downtime with spares
TARGET_RATIO = 10.0  # ... and at least this much shorter than torchrun's restart from disk


class SpareSampler:
    """Samples the RSS of every waiting spare process (a ``spare.py`` command line) once a second."""

    def __init__(self) -> None:
        self.samples: list[int] = []  # RSS of one spare, bytes, per sample
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for p in psutil.process_iter(["cmdline"]):
                try:
                    cmd = p.info["cmdline"] or []
                    ours = any(a.startswith(TRIAL_DIRS) for a in cmd)  # this benchmark's trials only
                    if ours and any(a.endswith("agent/spare.py") for a in cmd):
                        self.samples.append(p.memory_info().rss)
                except psutil.Error:
                    pass

    def __enter__(self) -> SpareSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def spinner() -> subprocess.Popen:
    """Another process that keeps one core busy (the contended variant)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def run_variant(name: str, runs: int, limit: float, contended: bool) -> dict:
    kind, extra = VARIANTS[name]
    trials = []
    rss: list[int] = []
    for _ in range(runs):
        spin = spinner() if contended else None
        try:
            with SpareSampler() as sampler:
                trials.append(planned_trial(kind, limit, agent_extra=extra))
            rss += sampler.samples
        finally:
            if spin is not None:
                spin.kill()
                spin.wait(5)
    down = [t["downtime_s"] for t in trials if t["ok"]]
    return {
        **summarize(down),
        "runs": runs,
        "failed": runs - len(down),
        "spare_rss_bytes": summarize([float(x) for x in rss]) if rss else None,
        "spare_rss_mib": summarize([x / 2**20 for x in rss]) if rss else None,
        "trials": [t for t in trials if t["ok"]],
        "errors": [t.get("error") for t in trials if not t["ok"]],
    }


def main() -> None:
    from elastic_rm.agent import cgroup as cg

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=2, help="trials per spares variant (default 2)")
    p.add_argument("--baseline-runs", type=int, default=1, help="trials per baseline (default 1)")
    p.add_argument(
        "--limit", type=float, default=120.0, help="seconds to wait for the new round (default 120)"
    )
    p.add_argument("--contended", action="store_true", help="keep one core busy during every trial")
    p.add_argument("--name", default=None, help="results file name (default recovery-spares[-contended])")
    p.add_argument("--variants", nargs="*", default=None, help=f"only these (default all): {list(VARIANTS)}")
    args = p.parse_args()
    names = [n for n in VARIANTS if cg.detect() is not None or not n.endswith("straggler-swap")]
    if args.variants:
        unknown = set(args.variants) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {list(VARIANTS)}")
        names = [n for n in names if n in args.variants]
    load_before = os.getloadavg()
    results = {}
    for name in names:
        runs = args.runs if "+spares" in name else args.baseline_runs
        results[name] = run_variant(name, runs, args.limit, args.contended)
        r = results[name]
        print(
            f"{name:38s} downtime median {fmt(r['median']):>9s}  failed {r['failed']}/{r['runs']}", flush=True
        )

    def median(name: str) -> float | None:
        return results.get(name, {}).get("median")

    ratios: dict[str, float | None] = {}
    print("\nratios (baseline downtime / elastic-rm downtime; higher is better):")
    for name in (n for n in results if "+spares" in n):
        rounds = name.split("/")[1]
        bases = ["torchrun/disk-restart", f"ermrun-new-processes/{rounds}"]
        if rounds == "scale-up":
            bases.append("torchrun/scale-up")
        for base in bases:
            ours, value = median(name), median(base)
            ratios[f"{name} vs {base}"] = value / ours if value and ours else None
            print(f"  {name} vs {base}: " + (f"{value / ours:.1f}x" if value and ours else "n/a"))
    targets = {
        name: {
            "median_le_1s": (median(name) or 1e9) <= TARGET_S,
            "ratio_vs_disk_ge_10x": (ratios.get(f"{name} vs torchrun/disk-restart") or 0) >= TARGET_RATIO,
        }
        for name in results
        if "+spares" in name
    }
    payload = {
        "results": results,
        "ratios": ratios,
        "targets": targets,
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "config": {**vars(args), "preload": PRELOAD},
    }
    name = args.name or ("recovery-spares-contended" if args.contended else "recovery-spares")
    print("wrote", write_result(name, payload))


if __name__ == "__main__":
    main()
