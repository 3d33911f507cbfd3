"""`erm status --json` on a live 2-node job matches the truth; a malformed record is reported, not fatal."""

from __future__ import annotations

import json
import os
import subprocess

from elastic_rm.etcd.client import EtcdClient
from tests.conftest import BIN, REPO, Proc
from tests.launcher.helpers import records, wait_until

REPORTING = os.path.join(REPO, "tests", "workers", "reporting.py")


def status(etcd, run_id) -> dict:
    out = subprocess.run(
        [os.path.join(BIN, "erm"), "status", "--endpoint", etcd.endpoint, "--run-id", run_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_status_of_a_live_job_matches_etcd_and_survives_garbage(etcd, run_id, tmp_path, procs):
    for name in ("a", "b"):
        argv = [os.path.join(BIN, "ermrun"), "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint",
                etcd.endpoint, "--rdzv-id", run_id, "--rdzv-conf", "lease_ttl=2", "--node-id", name, REPORTING]  # fmt: skip
        procs.append(
            Proc(argv, str(tmp_path / f"{name}.log"), env={"STEPS_DIR": str(tmp_path), "STEPS_NODE": name})
        )
    wait_until(
        lambda: all(any("step" in r for r in records(tmp_path, n)) for n in "ab"), 120, "training", procs
    )
    wait_until(
        lambda: all(m.get("samples_per_s") for m in status(etcd, run_id)["members"]), 20, "step rates", procs
    )
    s = status(etcd, run_id)
    with EtcdClient(etcd.endpoint) as c:
        truth = json.loads(c.get(f"/elastic-rm/{run_id}/round").value)
        leader = c.get(f"/elastic-rm/{run_id}/leader").value.decode()
        c.put(f"/elastic-rm/{run_id}/metrics/zz", b"{broken")
    assert s["round"] == truth["round"] and s["complete"] and s["world_size"] == 2
    assert [m["node"] for m in s["members"]] == truth["members"] and s["leader"] == leader
    assert all(m["state"] == "active" and m["step_p50_s"] > 0 for m in s["members"])
    assert s["decisions"][-1]["round"] == truth["round"]
    broken = status(etcd, run_id)
    assert any("metrics/zz" in e for e in broken["errors"]) and broken["world_size"] == 2
