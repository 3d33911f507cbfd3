"""The agent under ermrun: metrics in etcd, drain at a step boundary on a new round, torchrun parity."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.metrics import parse_record
from tests.conftest import REPO, Proc
from tests.e2e.helpers import ermrun_here, records, wait_until
from tests.ermrun_argv import TORCHRUN, ermrun_argv, flags, node_args

REPORTING = os.path.join(REPO, "tests", "workers", "reporting.py")
DDP = os.path.join(REPO, "tests", "workers", "ddp_linear.py")


def node(tmp_path, etcd, run_id, name, nnodes="2:3", script=REPORTING, nproc=1, extra=()):
    argv = ermrun_argv(
        *node_args(etcd.endpoint, run_id, nnodes, name, nproc=nproc), *extra, script, monitor_interval=0.1
    )
    return Proc(
        argv, str(tmp_path / f"{name}.agent.log"), env={"STEPS_DIR": str(tmp_path), "STEPS_NODE": name}
    )


def test_metrics_reach_etcd_with_cpu_and_step_times(etcd, run_id, tmp_path, procs):
    p = node(tmp_path, etcd, run_id, "m", nnodes="1")
    procs.append(p)
    key = f"/elastic-rm/{run_id}/metrics/m"
    found = []
    with EtcdClient(etcd.endpoint) as c:

        def busy_record() -> bool:
            """A record with step times and the worker's CPU use: how much of a core the busy worker gets
            depends on the machine's load, so any use counts."""
            kv = c.get(key)
            rec = None if kv is None else parse_record(kv.value, key=key)
            if rec and rec.steps and rec.steps.steps > 0 and rec.workers and rec.workers[0].cpu_util > 0:
                found.append(rec)
            return bool(found)

        wait_until(lambda: any("step" in r for r in records(tmp_path, "m")), 90, "training", [p])
        first_step = min(r["t"] for r in records(tmp_path, "m") if "step" in r)
        wait_until(busy_record, 10, "a metrics record with step times and the worker's CPU", [p])
    rec = found[0]
    assert rec.t >= first_step  # sampled after the worker's first step, which it reports
    assert rec.steps.p50_s >= 0.02 and rec.steps.samples_per_s > 0  # a step computes for 20 ms at least
    assert rec.mem_total_bytes > 0 and rec.workers[0].rss_bytes > 10 * 2**20


# 25 s; CI keeps the drain at a step boundary in tests/e2e/test_erm_status.py's job and
# test_inplace_rounds.py's scale-up
@pytest.mark.slow
def test_new_round_drains_workers_at_a_step_boundary(etcd, run_id, tmp_path, procs):
    nodes = [node(tmp_path, etcd, run_id, n) for n in ("a", "b")]
    procs.extend(nodes)
    wait_until(
        lambda: all(
            sum(1 for r in records(tmp_path, n) if r.get("world") == 2 and "step" in r) > 10
            for n in ("a", "b")
        ),
        120,
        "2 nodes training",
        nodes,
    )
    c = node(tmp_path, etcd, run_id, "c")
    procs.append(c)
    wait_until(
        lambda: all(
            any(r.get("world") == 3 and "step" in r for r in records(tmp_path, n)) for n in ("a", "b", "c")
        ),
        120,
        "world 3 after the scale-up round",
        [*nodes, c],
    )
    for name in ("a", "b"):
        rows = records(tmp_path, name)
        stop = next(r for r in rows if "stopped_at" in r)
        last_step_before = max(r["step"] for r in rows if r.get("world") == 2 and "step" in r)
        assert stop["stopped_at"] == last_step_before  # the hook saw the last completed step
    stops = {next(r["stopped_at"] for r in records(tmp_path, n) if "stopped_at" in r) for n in ("a", "b")}
    assert len(stops) == 1  # both nodes stopped at the same step


# 47 s; CI keeps tests/e2e/test_ermrun_nodes.py's torchrun environment and stock torchrun on our backend
@pytest.mark.slow
def test_unmodified_ddp_script_matches_torchrun(etcd, run_id, tmp_path, procs):
    outs = {}
    for name in ("x", "y"):
        p = Proc(
            ermrun_argv(*node_args(etcd.endpoint, run_id, "2", name, nproc=2), DDP),
            str(tmp_path / f"{name}.log"),
            env={"DDP_OUT": str(tmp_path / "ermrun.out")},
        )
        procs.append(p)
        outs[name] = p
    for p in outs.values():
        assert p.wait(120) == 0, p.output()[-2000:]
    ref = subprocess.run(
        [TORCHRUN, *flags(log_dir=tmp_path / "logs", standalone=True, nproc_per_node=4), DDP],
        env={**os.environ, "DDP_OUT": str(tmp_path / "torchrun.out")},
        capture_output=True,
        timeout=120,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    ours, theirs = (
        json.loads((tmp_path / "ermrun.out").read_text()),
        json.loads((tmp_path / "torchrun.out").read_text()),
    )
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-7)


def test_bad_agent_flags_are_clear_errors(tmp_path, capfd, monkeypatch):
    assert ermrun_here(["--sample-interval", "-1", REPORTING]) == 2  # in this process: refused at once
    err = capfd.readouterr().err
    assert "ermrun: error: --sample-interval must be > 0" in err, err[-2000:]
    # refused once the rendezvous handler exists: its threads (leader, peer probe) end with the refusal
    monkeypatch.setenv("STEPS_DIR", str(tmp_path))
    before = {t.name for t in threading.enumerate()} | {"etcd-io"}  # the process's one etcd event loop
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ermrun_here(["--metrics-port", str(port), REPORTING]) == 2
    err = capfd.readouterr().err
    assert str(port) in err and "Traceback" not in err, err[-2000:]
    deadline = time.monotonic() + 10
    while (left := {t.name for t in threading.enumerate()} - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, left
