"""The trace families of users who hurt: what each one changes in the ground truth, and only that."""

import csv
import statistics

import numpy as np

from elastic_rm.planner.sim import worker_noise
from elastic_rm.planner.sim.cluster import ClusterSpec
from elastic_rm.planner.sim.trace import FIELDS, OPTIONAL, load_trace, write_trace
from elastic_rm.planner.sim.tracegen import generate
from elastic_rm.planner.sim.truth import hurt, ideal_step

SPEC = ClusterSpec(machines=8)


def test_each_family_changes_what_it_says():
    base = generate(80, 4, SPEC, family="right-sized")
    noisy = generate(80, 4, SPEC, family="noisy")
    assert all(0.05 <= j.step_cv <= 0.2 for j in noisy) and {j.step_cv for j in base} == {0.03}
    assert all(120 <= j.warmup_s <= 600 for j in generate(80, 4, SPEC, family="slow-warmup"))
    short = generate(80, 4, SPEC, family="short")
    assert all(300 <= j.work_samples / j.global_batch * ideal_step(j, j.req_nodes) <= 700.01 for j in short)
    skew = generate(80, 4, SPEC, family="data-skew")
    assert all(0.2 <= j.skew_at_frac <= 0.8 and 0.5 <= j.skew_factor <= 2.0 for j in skew)
    assert all(j.worker_noise == 1 for j in generate(20, 4, SPEC, family="pai-noise"))
    lies = generate(200, 4, SPEC, family="history-lies")
    by_name: dict[str, set[float]] = {}
    for j in lies:
        by_name.setdefault(j.name, set()).add(j.t_compute)
    recurring = [v for k, v in by_name.items() if k.startswith("rec")]
    assert sum(len(v) > 1 for v in recurring) >= len(recurring) // 2  # the same job, another model


def test_data_skew_changes_the_compute_past_its_point():
    j = next(j for j in generate(30, 4, SPEC, family="data-skew"))
    assert hurt(j, j.skew_at_frac - 1e-6) is j
    assert hurt(j, j.skew_at_frac).t_compute == j.t_compute * j.skew_factor


def test_worker_noise_follows_the_pai_table():
    xs = worker_noise.draw(np.random.default_rng(1), 20000)
    assert abs(statistics.median(xs) - 1.0) < 0.005
    assert min(xs) >= worker_noise.RATIO[0] and max(xs) <= worker_noise.RATIO[-1]
    assert abs(np.quantile(xs, 0.9) - 1.05) < 0.01


def test_new_columns_round_trip_and_older_traces_still_load(tmp_path):
    jobs = generate(6, 4, SPEC, family="data-skew")
    path = tmp_path / "t.csv"
    write_trace(str(path), jobs)
    back = {j.job_id: j for j in load_trace(str(path))}
    assert all(abs(back[j.job_id].skew_factor - j.skew_factor) < 1e-8 for j in jobs)
    old = tmp_path / "old.csv"
    with open(path) as f, open(old, "w", newline="") as g:
        rows = list(csv.DictReader(f))
        w = csv.DictWriter(g, fieldnames=[k for k in FIELDS if k not in OPTIONAL])
        w.writeheader()
        w.writerows({k: v for k, v in r.items() if k not in OPTIONAL} for r in rows)
    assert {j.skew_factor for j in load_trace(str(old))} == {1.0}
