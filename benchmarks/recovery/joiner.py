"""The joining worker's own work in a round in place, two cuts measured against their baselines.

- The sharding plan, made again at every round: TorchRec's default proposers (the baseline) against
  ``GreedyProposer`` alone, for the example's model at world sizes 2-4 (the plans must be the same).
- The first full collection of a worker from a warm spare (``rounds()`` does one before its first round):
  in a fresh process after the spare's preloads, without (the baseline) and with the spare's freeze of
  what the imports made (``gc.freeze()``, elastic_rm/agent/spare.py).

    python -m benchmarks.recovery.joiner [--runs 5]
Writes benchmarks/results/recovery-joiner.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

from benchmarks.common import summarize, write_result
from benchmarks.recovery.spares import PRELOAD

COLLECT = """
import gc, importlib, json, sys, time
for name in sys.argv[2].split(","):
    importlib.import_module(name)
if sys.argv[1] == "frozen":
    gc.collect(); gc.freeze()  # what the spare does after its preloads
sys.path.insert(0, "examples/dlrm")
import train  # the example script's own imports
t = time.perf_counter(); gc.collect(); print(json.dumps(time.perf_counter() - t))
"""


def plan_times(runs: int) -> dict:
    import torchrec.optim as trec_optim
    from torchrec.distributed.planner.proposers import GreedyProposer
    from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

    from elastic_rm.checkpoint.plan_record import plan_digest
    from elastic_rm.train import WorldTopology, plan_sharding

    example = _example()

    def model_of_the_example():
        model, _ = example.build_model(args)
        apply_optimizer_in_backward(
            trec_optim.RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05}
        )
        return model

    args = example.parse_args()
    out = {}
    for world in (2, 3, 4):
        row = {}
        for name, proposer in (("default", lambda: None), ("greedy", GreedyProposer)):
            times, digests = [], set()
            for _ in range(runs + 1):  # the first is a warm-up
                model = model_of_the_example()
                t = time.perf_counter()
                plan = plan_sharding(
                    model, WorldTopology(world, 1), check_same_on_all_ranks=False, proposer=proposer()
                )
                times.append(time.perf_counter() - t)
                digests.add(plan_digest(plan))
            row[name] = {**summarize(times[1:]), "digest": sorted(digests)}
        row["same_plan"] = row["default"]["digest"] == row["greedy"]["digest"]
        row["ratio"] = row["default"]["median"] / row["greedy"]["median"]
        out[f"world{world}"] = row
        print(
            f"world {world}: default {row['default']['median'] * 1e3:.1f} ms, greedy "
            f"{row['greedy']['median'] * 1e3:.1f} ms ({row['ratio']:.1f}x), same plan: {row['same_plan']}"
        )
    return out


def _example():
    """examples/dlrm/train.py as a module (its defaults: the argv it parses is this one's, emptied)."""
    spec = importlib.util.spec_from_file_location(
        "dlrm_example", os.path.join("examples", "dlrm", "train.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = sys.argv[:1]
    return module


def collect_times(runs: int) -> dict:
    out = {}
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for mode in ("plain", "frozen"):
        times = [
            json.loads(
                subprocess.run(
                    [sys.executable, "-c", COLLECT, mode, PRELOAD],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.splitlines()[-1]
            )
            for _ in range(runs)
        ]
        out[mode] = summarize(times)
    out["ratio"] = out["plain"]["median"] / max(out["frozen"]["median"], 1e-6)
    print(
        f"first full collection: {out['plain']['median'] * 1e3:.0f} ms without the spare's freeze, "
        f"{out['frozen']['median'] * 1e3:.1f} ms with it"
    )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    before = os.getloadavg()
    plans = plan_times(args.runs)
    collect = collect_times(args.runs)
    path = write_result(
        "recovery-joiner",
        {
            "config": vars(args),
            "plan": plans,
            "collect": collect,
            "load_avg_before": before,
            "load_avg_after": os.getloadavg(),
        },
    )
    print(path)


if __name__ == "__main__":
    main()
