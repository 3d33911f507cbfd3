import csv
import random
import statistics

import pytest

from elastic_rm.planner.sim.cluster import GIB, Cluster, ClusterSpec
from elastic_rm.planner.sim.engine import Instability, Simulator
from elastic_rm.planner.sim.report import compare, table
from elastic_rm.planner.sim.trace import FIELDS, TraceError, load_trace, write_trace
from elastic_rm.planner.sim.tracegen import generate
from elastic_rm.planner.sim.truth import knee, mem_used, step

SMALL = ClusterSpec(machines=4)


def test_trace_round_trips_through_csv(tmp_path):
    jobs = generate(15, 3, SMALL)
    path = tmp_path / "t.csv"
    write_trace(str(path), jobs)
    back = load_trace(str(path))
    assert [j.job_id for j in back] == [j.job_id for j in sorted(jobs, key=lambda j: (j.submit_s, j.job_id))]
    by_id = {j.job_id: j for j in jobs}
    for j in back:
        o = by_id[j.job_id]
        assert (j.req_nodes, j.n_tables, j.name) == (o.req_nodes, o.n_tables, o.name)
        assert j.work_samples == pytest.approx(o.work_samples, rel=1e-9)


def _write(tmp_path, rows: list[dict], fields=FIELDS):
    path = tmp_path / "bad.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return str(path)


def test_malformed_traces_name_file_line_and_field(tmp_path):
    good = {k: v for k, v in generate(2, 1, SMALL)[0].__dict__.items()}
    p = _write(tmp_path, [good, {**good, "job_id": "x2", "dim": "wide"}])
    with pytest.raises(TraceError, match=r"bad.csv:3: field 'dim': expected an integer, got 'wide'"):
        load_trace(p)
    p = _write(
        tmp_path,
        [{k: v for k, v in good.items() if k != "t_compute"}],
        [f for f in FIELDS if f != "t_compute"],
    )
    with pytest.raises(TraceError, match=r"bad.csv:1: missing column\(s\) t_compute"):
        load_trace(p)
    p = _write(tmp_path, [good, good])
    with pytest.raises(TraceError, match=r":3: field 'job_id': duplicate"):
        load_trace(p)
    p = _write(tmp_path, [{**good, "req_nodes": good["req_max_nodes"] + 1}])
    with pytest.raises(TraceError, match=r":2: field 'req_nodes'"):
        load_trace(p)
    p = _write(tmp_path, [{**good, "work_samples": "-1"}])
    with pytest.raises(TraceError, match=r":2: field 'work_samples': must be > 0"):
        load_trace(p)
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(str(tmp_path / "missing.csv"))


def test_generator_follows_the_reference_over_provisioning():
    jobs = generate(400, 5)
    cpu, mem = [], []
    for j in jobs:
        s = step(j, [1.0] * j.req_nodes, [j.req_cpu_per_node] * j.req_nodes)
        cpu.append(max(s.cpu_used) / j.req_cpu_per_node)
        avg_mem = (mem_used(j, j.req_nodes, 0.0) + mem_used(j, j.req_nodes, 1.0)) / 2
        mem.append(min(avg_mem / (j.req_mem_gib_per_node * GIB), 1.0))
    assert 0.12 < statistics.fmean(cpu) < 0.25  # reference: CPU used/requested ~0.15-0.20
    assert 0.10 < statistics.fmean(mem) < 0.25  # reference: memory ~0.13-0.15 (+ the under-provisioned)
    under = sum(mem_used(j, j.req_nodes, 1.0) > j.req_mem_gib_per_node * GIB for j in jobs) / len(jobs)
    assert 0.04 < under < 0.25  # OOM from too little memory is the main failure
    names = [j.name for j in jobs]
    assert sum(n.startswith("rec") for n in names) == pytest.approx(0.6 * len(jobs), abs=1)
    ratio = [j.req_nodes / knee(j, 1, 32) for j in jobs]
    assert min(ratio) < 0.6 and max(ratio) > 1.6  # users both under- and over-ask
    assert all(a.submit_s <= b.submit_s for a, b in zip(jobs, jobs[1:], strict=False))


def test_generator_is_seeded():
    assert generate(10, 9) == generate(10, 9) != generate(10, 10)


def test_cluster_first_fit_and_release():
    c = Cluster(ClusterSpec(machines=2, cores=10, mem_gib=10, gpus=2))
    assert c.allocate(6, 6 * GIB, 1) == 0
    assert c.allocate(6, 6 * GIB, 1) == 1  # does not fit beside the first
    assert c.allocate(6, 6 * GIB, 1) is None
    c.release(0, 6, 6 * GIB, 1)
    assert c.allocate(4, 4 * GIB, 2) == 0
    assert c.resize(0, (4, 4 * GIB), (10, 10 * GIB)) and not c.resize(1, (6, 6 * GIB), (11, 6 * GIB))


@pytest.fixture(scope="module")
def small_runs():
    jobs = generate(30, 2, SMALL)
    return jobs, {p: Simulator(jobs, SMALL, p, 2).run() for p in ("static", "optimus", "ours")}


def test_simulation_finishes_and_accounts(small_runs):
    jobs, runs = small_runs
    for name, out in runs.items():
        assert len(out) == len(jobs)
        assert all(j.status in ("completed", "failed", "rejected") for j in out), name
        for j in out:
            if j.status == "completed":
                assert j.end_s >= j.start_s >= j.trace.submit_s
                assert j.progress == pytest.approx(j.trace.work_samples)
    s = compare(runs)
    assert set(s) == {"static", "optimus", "ours"}
    for v in s.values():
        assert 0 < v["cpu_util"] <= 1 and 0 < v["mem_util"] <= 1 and 0 <= v["gpu_util"] <= 1
    assert s["static"]["rounds_per_job"] < s["ours"]["rounds_per_job"]
    assert s["ours"]["completed"] >= s["static"]["completed"] - 1
    assert s["ours"]["cpu_util"] > s["static"]["cpu_util"]  # right-sizing shows even on 30 jobs
    assert "mean JCT (h)" in table(s)


@pytest.fixture(scope="module")
def ours_again(small_runs):
    """small_runs' "ours" run once more, on the same jobs, with what its ticks saw recorded: the run
    test_simulation_is_deterministic compares and test_snapshots_carry_the_queue_the_cluster_had reads
    (one simulation for both; the recording only reads the simulator's state)."""
    jobs, _ = small_runs
    sim = Simulator(jobs, SMALL, "ours", 2)
    seen, tick = [], sim._policy_tick
    ticks = []

    def record(job, now):
        seen.append((now, sim._snapshot(job, now).waiting_nodes))
        return tick(job, now)

    sim._policy_tick = record
    account = sim._account

    def after_tick(running, now, queued):
        ticks.append((now, sim.waiting, queued))
        return account(running, now, queued)

    sim._account = after_tick
    return sim, sim.run(), seen, ticks


def test_simulation_is_deterministic(small_runs, ours_again):
    _, runs = small_runs
    _, again, _, _ = ours_again
    assert [(j.status, j.end_s, j.rounds) for j in again] == [
        (j.status, j.end_s, j.rounds) for j in runs["ours"]
    ]


def test_without_faults_and_with_generous_memory_nothing_fails():
    big = ClusterSpec(machines=24)
    jobs = [
        j.__class__(
            **{
                **j.__dict__,
                "error_at_frac": 0.0,
                "req_mem_gib_per_node": 1.5 * mem_used(j, j.req_nodes, 1.0) / GIB,
            }
        )
        for j in generate(12, 4, big)
    ]
    calm = Instability(fail_per_node_h=0.0, straggler_per_node_h=0.0)
    for p in ("static", "ours"):
        out = Simulator(jobs, big, p, 4, calm).run()
        assert all(j.status == "completed" for j in out), [
            (j.trace.job_id, j.reason) for j in out if j.status != "completed"
        ]


def test_binary_or_empty_trace_is_an_error_not_a_crash(tmp_path):
    p = tmp_path / "bin.csv"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="bin.csv"):
        load_trace(str(p))
    p.write_text(",".join(FIELDS) + "\n")
    with pytest.raises(TraceError, match="no jobs"):
        load_trace(str(p))


def test_snapshots_carry_the_queue_the_cluster_had(ours_again):
    """``waiting_nodes`` in every snapshot is what the jobs queued at the previous tick's end asked for."""
    sim, _, seen, ticks = ours_again
    by_tick = {now: w for now, w, _ in ticks}
    assert any(q for _, _, q in ticks), "the small cluster queued jobs"
    assert all((w > 0) == (q > 0) for _, w, q in ticks)
    for now, w in seen:
        assert w == by_tick.get(now - sim.tick, 0), now  # the previous tick's queue
    assert any(w for _, w in seen)


def test_results_keep_numpy_scalars_as_the_python_values_they_hold(tmp_path):
    """A comparison of simulator floats (numpy float64) is a numpy bool: the planner benchmark's targets.
    Its results file says true / false, not 1.0, and the shared writer of benchmarks/ does not fail on it."""
    import json

    import numpy as np

    from benchmarks.common import write_result
    from elastic_rm.planner.sim.report import write_json

    payload = {"met": np.float64(0.2) < 0.31, "value": np.float64(1.5), "n": np.int64(3)}
    write_json(str(tmp_path / "a.json"), payload)
    write_result("b", payload, results_dir=str(tmp_path))
    for name in ("a.json", "b.json"):
        data = json.loads((tmp_path / name).read_text())
        assert data["met"] is True and data["value"] == 1.5 and data["n"] == 3, data


def test_a_whole_machine_fits_again_after_float_sums_of_slices():
    spec = ClusterSpec(machines=1, cores=96.0, mem_gib=768.0, gpus=8)
    rng = random.Random(1)
    for _ in range(20):  # slices of odd sizes come and go in another order, as the simulated jobs' do
        c = Cluster(spec)
        slices = [(rng.uniform(1, 20), rng.uniform(1, 150) * GIB) for _ in range(5)]
        for cpu, mem in slices:
            assert c.allocate(cpu, mem, 1) == 0
        rng.shuffle(slices)
        for cpu, mem in slices:
            c.release(0, cpu, mem, 1)
        assert c.can_fit_count(spec.cores, spec.mem_gib * GIB, spec.gpus) == 1


def shaped(base, spec, shapes):
    """``base``'s jobs reshaped, one per (nodes, min, max, work factor, arrival s): whole machines each,
    memory 1.5x what the job needs at its largest size, no error."""
    return [
        j.__class__(
            **{
                **j.__dict__,
                "submit_s": at,
                "gpus_per_node": spec.gpus,
                "req_nodes": n,
                "req_min_nodes": lo,
                "req_max_nodes": hi,
                "req_cpu_per_node": 8.0,
                "req_mem_gib_per_node": 1.5 * mem_used(j, hi, 1.0) / GIB,
                "work_samples": j.work_samples * work,
                "error_at_frac": 0.0,
            }
        )
        for j, (n, lo, hi, work, at) in zip(base, shapes, strict=True)
    ]


@pytest.mark.parametrize("policy", ["ours", "optimus"])
def test_an_elastic_start_below_its_size_leaves_a_later_job_its_backfill(policy):
    """Three jobs queue at once on three whole-machine slots: a long 2-node job, then one asking for 3 that
    may start on 1, then a 1-node job. Static's backfill starts the 1-node job at once (the 3-node one does
    not fit); the elastic cluster does the same and starts the 3-node job below its size only on what is
    left, not on the node the 1-node job starts on."""
    spec = ClusterSpec(machines=3)
    base = generate(3, 5, spec)
    # nodes, min, max, work (x its own), arrival
    jobs = shaped(base, spec, [(2, 2, 2, 40.0, 0.0), (3, 1, 3, 1.0, 0.0), (1, 1, 1, 1.0, 0.0)])
    calm = Instability(fail_per_node_h=0.0, straggler_per_node_h=0.0)
    static = {j.trace.job_id: j for j in Simulator(jobs, spec, "static", 5, calm).run()}
    elastic = {j.trace.job_id: j for j in Simulator(jobs, spec, policy, 5, calm).run()}
    long_job, big, small = (j.job_id for j in jobs)
    assert static[long_job].start_s == static[small].start_s == 0.0
    assert static[big].start_s > 0.0  # static: the 3-node job waits for the long one
    assert elastic[long_job].start_s == elastic[small].start_s == 0.0
    assert elastic[small].end_s <= static[small].end_s


def test_an_early_start_below_its_size_is_called_in_by_a_later_job_that_would_backfill():
    """Four whole-machine slots: a long 2-node job and one asking for 3 that starts on the 2 left (short),
    then, later, a 2-node job. Static would have run the later job on those 2 nodes (the 3-node one still
    waiting); with call-in the short start gives them back at once and resumes afterwards, once."""
    spec = ClusterSpec(machines=4)
    base = generate(3, 5, spec)
    jobs = shaped(base, spec, [(2, 2, 2, 6.0, 0.0), (3, 1, 3, 3.0, 0.0), (2, 2, 2, 1.0, 600.0)])
    calm = Instability(fail_per_node_h=0.0, straggler_per_node_h=0.0)
    plain = {j.trace.job_id: j for j in Simulator(jobs, spec, "ours-fixed-size", 5, calm).run()}
    called = {j.trace.job_id: j for j in Simulator(jobs, spec, "ours-fixed-size-call-in", 5, calm).run()}
    long_job, short, later = (j.job_id for j in jobs)
    for run in (plain, called):
        assert run[short].start_s == 0.0 and run[short].started_short and not run[long_job].started_short
    assert not plain[short].called_in and plain[later].start_s > 600.0  # it waits for nodes to free
    assert called[short].called_in and called[later].start_s == 600.0  # at its arrival's tick
    assert all(j.status == "completed" for j in called.values())
    assert called[later].end_s < plain[later].end_s
    assert sum("called in by" in d for d in called[short].decisions) == 1
