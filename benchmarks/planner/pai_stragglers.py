"""`python -m benchmarks.planner.pai_stragglers`: public per-worker mini-batch times of four 10-worker jobs
on Alibaba's PAI (the "Mini-batch Time of Workers in Distributed Training Jobs on PAI" release of
alibaba/clusterdata, used in the AntMan paper, OSDI'20) replayed through the planner's straggler detector
(elastic_rm.planner.runtime.update_stragglers) as the nodes' busy times, one sample per recorded iteration.

Per job: which workers were flagged and when, the detection delay from the first sample a worker ran
slower than ``straggler_k`` x the members' median, the share of flagged samples on workers the release
does not name as stragglers (false positives), and what replacing a flagged worker costs (one round at
the measured downtime) against what it gains (the slowdown it removes while it lasts), in steps.
"""

from __future__ import annotations

import csv
import os
import sys
from dataclasses import replace

from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.runtime import reference_busy, update_stragglers
from elastic_rm.planner.state import NodeSample, PlannerState

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
# what the release's README says of each job (its "Observation"), as worker sets
NAMED = {
    1: ("a straggler (worker 6) emerges in the middle of the training", {6}),
    2: ("stable: different workers have different, steady mini-batch times", set()),
    3: ("multiple stragglers", None),  # the release names none; late drift of several workers
    4: ("multiple stragglers; times fluctuate (two classes ~4x apart)", None),
}


def load(job: int) -> list[tuple[int, dict[str, float]]]:
    """[(iteration, {worker: normalised mini-batch time})] from benchmarks/planner/data/pai_job<N>.csv."""
    with open(os.path.join(DATA, f"pai_job{job}.csv"), newline="") as f:
        rows = list(csv.reader(f))
    names = rows[0][1:]
    return [(int(r[0]), {n: float(v) for n, v in zip(names, r[1:], strict=True) if v}) for r in rows[1:]]


def replay(
    samples: list[tuple[int, dict[str, float]]], cfg: PlannerConfig
) -> list[tuple[int, frozenset[str]]]:
    """The flagged set after each sample (busy time = the worker's mini-batch time)."""
    state = replace(PlannerState(), round_active_at=float("-inf"))
    members = tuple(sorted({w for _, ws in samples for w in ws}))
    out = []
    for i, (it, ws) in enumerate(samples):
        now = float(i)
        nodes = {w: ((NodeSample(now, t, 0.0, 0.0, 0.0, 0.0, -1.0, False)),) for w, t in ws.items()}
        state = replace(state, nodes=nodes)
        slow, flagged = update_stragglers(state, tuple(w for w in members if w in ws), now, cfg)
        state = replace(state, slow=slow, flagged=flagged)
        out.append((it, flagged))
    return out


def analyse(job: int, cfg: PlannerConfig, downtime_s: float, step_s: float) -> dict:
    samples = load(job)
    flags = replay(samples, cfg)
    named = NAMED[job][1]
    onset: dict[str, int] = {}
    for it, ws in samples:  # slower than k x the detector's own reference
        med = reference_busy(list(ws.values()), cfg.straggler_k)
        for w, t in ws.items():
            if t > cfg.straggler_k * med:
                onset.setdefault(w, it)
    first: dict[str, int] = {}
    flagged_samples = {}
    for it, fl in flags:
        for w in fl:
            first.setdefault(w, it)
            flagged_samples[w] = flagged_samples.get(w, 0) + 1
    every = max(samples[1][0] - samples[0][0], 1) if len(samples) > 1 else 1
    delay = {w: (first[w] - onset[w]) // every for w in first if w in onset}
    n_flag = sum(flagged_samples.values())
    fp = None
    if named is not None:
        fp = sum(v for w, v in flagged_samples.items() if int(w.removeprefix("worker")) not in named)
    # gain of a replacement: the slowdown it removes for as long as the worker stayed flagged
    gain_steps = 0.0
    for w in flagged_samples:  # in steps at the reference pace (a synchronous step waits for the slowest)
        ratios = [
            ws[w] / reference_busy(list(ws.values()), cfg.straggler_k)
            for (_, ws), (_, fl) in zip(samples, flags, strict=True)
            if w in fl and w in ws
        ]
        gain_steps += sum(max(r - 1.0, 0.0) for r in ratios) * every
    cost_steps = len(first) * downtime_s / step_s
    return {
        "about": NAMED[job][0],
        "samples": len(samples),
        "iterations_per_sample": every,
        "slow_onset": onset,
        "flagged_first_at": first,
        "flagged_samples": flagged_samples,
        "detection_delay_samples": delay,
        "false_positive_share": None if fp is None else (fp / n_flag if n_flag else 0.0),
        "false_positive_samples": fp,
        "replacements": len(first),
        "replacement_cost_steps": cost_steps,
        "gain_steps": gain_steps,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    from benchmarks.common import write_result

    p = argparse.ArgumentParser(
        prog="python -m benchmarks.planner.pai_stragglers", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--downtime-s", type=float, default=3.0, help="round downtime of a straggler swap in place"
    )
    p.add_argument(
        "--step-s", type=float, default=0.1, help="seconds per iteration assumed (times are normalised)"
    )
    a = p.parse_args(argv)
    load_before = os.getloadavg()
    cfg = PlannerConfig(round_warmup_s=0.0)
    jobs = {str(j): analyse(j, cfg, a.downtime_s, a.step_s) for j in NAMED}
    for j, r in jobs.items():
        print(
            f"job {j} ({r['about']}): flagged {sorted(r['flagged_first_at'])} "
            f"first at {r['flagged_first_at']}; "
            f"delay {r['detection_delay_samples']} samples; false positives {r['false_positive_share']}; "
            f"replacement cost {r['replacement_cost_steps']:.0f} steps vs gain {r['gain_steps']:.0f} steps"
        )
    data = {
        "config": {
            "straggler_k": cfg.straggler_k,
            "straggler_clear_k": cfg.straggler_clear_k,
            "straggler_enter": cfg.straggler_enter,
            "straggler_exit": cfg.straggler_exit,
        },
        "downtime_s": a.downtime_s,
        "step_s": a.step_s,
        "jobs": jobs,
        "load_avg": {"before": load_before, "after": os.getloadavg()},
    }
    print(f"wrote {write_result('stragglers-pai', data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
