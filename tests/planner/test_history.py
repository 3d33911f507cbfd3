import pytest

from elastic_rm.planner.config import GIB, PlannerConfig
from elastic_rm.planner.history import HistoryError, major_cluster_mean, parse_record, warm_start
from elastic_rm.planner.job import parse_job

from .helpers import JOB

SIG = parse_job(JOB).signature()


def rec(run: str, world: int, status: str = "completed", mem_gib: float = 10.0, t: float = 0.0, **kw) -> dict:
    d = {
        "v": 1,
        "signature": SIG,
        "run_id": run,
        "finished_at": t,
        "status": status,
        "world_size": world,
        "capacity": 1.0,
        "throughput": 1000.0 * world,
        "cpu_per_node_used": 6.0,
        "mem_per_node_peak_bytes": mem_gib * GIB,
        "mem_growth_bytes_per_s": 0.0,
        "coef": [],
        "duration_s": 3600,
    }
    d.update(kw)
    return d


def test_major_cluster_drops_outliers():
    assert major_cluster_mean([4, 4, 5, 5, 100]) == pytest.approx(14 / 3)
    assert major_cluster_mean([7]) == 7
    assert major_cluster_mean([1, 2, 3, 4]) == pytest.approx(2.0)  # 3 values around the median


@pytest.mark.parametrize(
    "change, field",
    [
        ({"v": 2}, "'v'"),
        ({"world_size": 0}, "'world_size'"),
        ({"world_size": 2.5}, "'world_size'"),
        ({"status": "weird"}, "'status'"),
        ({"throughput": "fast"}, "'throughput'"),
        ({"coef": [1, 2]}, "'coef'"),
        ({"signature": 3}, "'signature'"),
    ],
)
def test_malformed_record_names_the_field(change, field):
    with pytest.raises(HistoryError, match=field):
        parse_record(rec("r", 2) | change, "history/x")


def test_record_round_trips():
    r = parse_record(rec("r1", 3, coef=[1e-5, 1.0, 1.0, 0.01]))
    assert parse_record(r.to_dict()) == r


def test_warm_start_is_robust_to_an_outlier_run_and_keeps_the_worst_memory():
    records = [
        parse_record(rec(f"r{i}", w, t=i, mem_gib=m))
        for i, (w, m) in enumerate([(4, 10), (4, 11), (5, 12), (16, 9)])
    ]
    plan = warm_start(parse_job(JOB), records, 1, 32, PlannerConfig())
    assert plan.world in (4, 5)  # the 16-node run is an outlier
    assert plan.from_history == 4
    assert plan.mem_per_node_bytes >= 12 * GIB * 1.2 * 0.9  # worst peak (rescaled) + 20% margin
    assert plan.cpu_per_node == pytest.approx(6.0 * 1.25 + 1.0)
    assert 0 < plan.confidence < 1 and "warm start" in plan.reason


def test_oom_run_raises_the_memory_floor_and_other_signatures_are_ignored():
    cfg = PlannerConfig()
    good = [parse_record(rec("a", 4, mem_gib=10, t=1))]
    oom = parse_record(rec("b", 4, status="oom", mem_gib=20, t=2))
    alien = parse_record(rec("c", 30, mem_gib=500, t=3, signature="other"))
    base = warm_start(parse_job(JOB), good, 1, 32, cfg)
    with_oom = warm_start(parse_job(JOB), [*good, oom, alien], 1, 32, cfg)
    assert with_oom.mem_per_node_bytes >= 20 * GIB * cfg.oom_restart_factor
    assert with_oom.mem_per_node_bytes > base.mem_per_node_bytes
    assert with_oom.world == base.world == 4


def test_cold_start_uses_the_request_within_bounds_and_the_memory_model():
    cfg = PlannerConfig()
    plan = warm_start(parse_job(JOB), [], 1, 8, cfg)
    assert plan.world == 2 and plan.coef == () and plan.confidence <= 0.3
    assert "cold start" in plan.reason
    assert plan.mem_per_node_bytes > cfg.cold_overhead_bytes
    assert warm_start(parse_job(JOB), [], 3, 8, cfg).world == 3  # clipped to MIN
    assert warm_start(parse_job(JOB), [], 1, 8, PlannerConfig(cold_start_nodes=6)).world == 6
    no_request = {k: v for k, v in JOB.items() if k != "request"}
    assert warm_start(parse_job(no_request), [], 1, 8, cfg).world == 8  # like torch: up to MAX
