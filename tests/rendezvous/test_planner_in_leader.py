"""The planner as the leader's round policy: a job description turns it on, metrics reach it."""

from __future__ import annotations

import json
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.planner.config import PlannerConfig
from elastic_rm.planner.history import warm_start
from elastic_rm.planner.job import parse_job
from elastic_rm.rendezvous.registration import create_handler

JOB = {
    "name": "ctr",
    "global_batch": 4096,
    "tables": [{"rows": 200000, "dim": 64}, {"rows": 50000, "dim": 32}],
    "dense_params": 100000,
}

RECORD = {
    "v": 1,
    "node": "x",
    "t": 0.0,
    "cpu": {"util_mean": 0.5, "util_max": 0.6, "util_last": 0.5},
    "mem": {"used_bytes": 2**30, "available_bytes": 2**31, "total_bytes": 2**33},
    "workers": [],
    "gpus": [],
    "steps": {"p50_s": 0.01, "p90_s": 0.012, "samples_per_s": 1000.0, "steps": 50, "age_s": 0.1},
}


def handlers(etcd, run_id, n, lo, hi, job_file, last_call="0.5"):
    conf = {"lease_ttl": "1", "last_call_timeout": last_call, "join_timeout": "20", "job_file": str(job_file)}
    return [
        create_handler(
            RendezvousParameters("elastic-rm", etcd.endpoint, run_id, lo, hi, local_addr="127.0.0.1", **conf)
        )
        for _ in range(n)
    ]


def job_named(name: str) -> dict:
    """JOB under a name of its own: a finished run is kept in etcd under the job's signature (the etcd of
    the test session outlives a test), and the next run of the same job warm-starts from it."""
    return {**JOB, "name": name}


def test_planner_decides_the_first_round_and_sees_metrics(etcd, run_id, tmp_path):
    job = job_named(f"ctr-{run_id}")  # no earlier run of it: a cold start
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    # min = max = 3: the first round forms once all three threads registered, however loaded the machine
    hs = handlers(etcd, run_id, 3, 3, 3, job_file)
    try:
        infos = join_all(hs, 3)
        start = warm_start(parse_job(job), [], 3, 3, PlannerConfig())
        assert {i.world_size for i in infos.values()} == {start.world} == {3}
        round_record = hs[0].view.round
        assert "cold start" in round_record.reason and round_record.confidence == pytest.approx(
            start.confidence
        )
        leader = next(h for h in hs if h.view.leader == h.node_id)
        member = next(h for i, h in enumerate(hs) if i in infos)
        member.services.publish_metrics(json.dumps({**RECORD, "node": member.node_id}).encode())
        deadline = time.monotonic() + 5
        while member.node_id not in leader.view.metrics and time.monotonic() < deadline:
            time.sleep(0.05)
        metrics = leader.view.metrics[member.node_id]
        assert metrics.steps is not None and metrics.steps.samples_per_s == 1000.0
    finally:
        for h in hs:
            h.release()


@pytest.mark.parametrize(
    "content,message",
    [(None, "cannot be read"), ("{oops", "is not JSON"), (json.dumps({"tables": []}), "tables")],
)
def test_bad_job_description_is_a_clear_error(etcd, run_id, tmp_path, content, message):
    job_file = tmp_path / "job.json"
    if content is not None:
        job_file.write_text(content)
    with pytest.raises(ValueError, match=message):
        handlers(etcd, run_id, 1, 1, 1, job_file)


def join_all(hs, expected, timeout=20.0):
    """Start every handler joining; return once ``expected`` of them hold a rank (the rest wait as
    standby)."""
    infos, errors = {}, {}

    def join(i):
        try:
            infos[i] = hs[i].next_rendezvous()
        except RendezvousClosedError as exc:  # a standby released at the end of the test
            errors[i] = exc

    for i in range(len(hs)):
        threading.Thread(target=join, args=(i,), daemon=True).start()
    deadline = time.monotonic() + timeout
    while len(infos) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return infos


def test_a_second_run_of_the_same_job_warm_starts_at_the_size_the_first_ended_at(etcd, tmp_path):
    job = job_named(f"ctr-warm-{time.monotonic_ns()}")
    job_file = tmp_path / "job.json"
    job_file.write_text(json.dumps(job))
    first_run = f"warm-a-{time.monotonic_ns()}"
    first = handlers(etcd, first_run, 2, 2, 3, job_file)  # the first run ended at 2 nodes
    try:
        infos = join_all(first, 2)
        assert {i.world_size for i in infos.values()} == {2}
        rank0 = next(h for h in first if h.joined_round.members[0] == h.node_id)
        for h in first:
            h.services.publish_metrics(json.dumps({**RECORD, "node": h.node_id}).encode())
        time.sleep(0.5)
        assert not next(h for h in first if h is not rank0).services.record_history()  # rank 0 alone writes
        assert rank0.services.record_history("completed")
    finally:
        for h in first:
            h.release()
    second = handlers(etcd, f"warm-b-{time.monotonic_ns()}", 3, 1, 3, job_file)  # 3 nodes offered this time
    try:
        infos = join_all(second, 2)
        time.sleep(0.5)  # a third member would have been admitted by now (last call 0.5 s)
        assert {i.world_size for i in infos.values()} == {2}  # not the cold start's 3
        assert "history" in second[0].view.round.reason or "finished run" in second[0].view.round.reason
    finally:
        for h in second:
            h.release()
        with EtcdClient(etcd.endpoint, timeout=10) as c:  # the session's etcd keeps no run of this job
            c.delete(f"/elastic-rm/history/{parse_job(job).signature()}/", prefix=True)


def test_a_history_record_the_planner_cannot_use_is_reported_naming_its_key(etcd, caplog):
    """The warm start skips a record that is JSON but not a history record (a NaN coefficient here); the
    leader reports it with its key, as it does one that is not JSON. It was skipped without a word."""
    from types import SimpleNamespace

    from elastic_rm.rendezvous.leader import RoundLeader

    from ..planner.test_history import rec

    job = job_named(f"ctr-history-{time.monotonic_ns()}")
    signature = parse_job(job).signature()
    prefix = f"/elastic-rm/history/{signature}/"
    good = {**rec("good", 2), "signature": signature}
    bad = {**good, "run_id": "bad", "coef": [float("nan"), 1.0, 1.0, 1.0]}
    with EtcdClient(etcd.endpoint, timeout=10) as c:
        try:
            c.put(prefix + "good", json.dumps(good))
            c.put(prefix + "bad", json.dumps(bad))  # json.dumps writes NaN, as json.loads reads it
            leader = SimpleNamespace(
                _job=job, _client=c, _view=SimpleNamespace(keys=SimpleNamespace(prefix="/elastic-rm"))
            )
            with caplog.at_level("ERROR", logger="elastic_rm.rendezvous.leader"):
                records = RoundLeader._read_history(leader)
        finally:
            c.delete(prefix, prefix=True)
    assert [r["run_id"] for r in records] == ["good"]
    assert any(prefix + "bad" in m and "coef" in m for m in caplog.messages), caplog.messages
