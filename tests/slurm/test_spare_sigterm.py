"""A spare ermrun stopped by SIGTERM before its workers ever started (what `erm launch --slurm` does to a
node job the run no longer wants, and Slurm to a job it cancels): it leaves cleanly and exits 0."""

from __future__ import annotations

import os
import shutil
import signal

import psutil
import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.keyspace import Keyspace
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import steps_at_world, wait_until
from tests.slurm.helpers import CONF, WORKER, gone

NODE_MEMORY = "/dev/shm/elastic-rm"


def ermrun(tmp_path, etcd, run_id, node: str) -> Proc:
    argv = [
        os.path.join(BIN, "ermrun"),
        "--nnodes",
        "1:1",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        CONF,
        "--monitor-interval",
        "0.1",
        "--node-id",
        node,
        WORKER,
    ]
    env = {**os.environ, "STEPS_DIR": str(tmp_path), "STEPS_MAX": "0"}
    return Proc(argv, str(tmp_path / f"{node}.log"), env=env, cwd=REPO)


@pytest.mark.slow
def test_a_spare_sigtermed_before_its_workers_start_leaves_and_exits_0(etcd, run_id, tmp_path, procs):
    member = ermrun(tmp_path, etcd, run_id, "m1")
    procs.append(member)
    wait_until(lambda: steps_at_world(tmp_path, "m1", 1) > 3, 120, "the member training", [member])
    # what an earlier agent with the spare's node id left in node memory (a Slurm node's name comes back)
    earlier = os.path.join(NODE_MEMORY, run_id, "s1")
    os.makedirs(earlier)
    with open(os.path.join(earlier, "kept"), "w") as f:
        f.write("an earlier member's checkpoint copy")
    try:
        spare = ermrun(tmp_path, etcd, run_id, "s1")  # beyond --nnodes MAX: it waits, no worker of its own
        procs.append(spare)
        keys = Keyspace("/elastic-rm", run_id)

        def registered() -> set[str]:
            with EtcdClient(etcd.endpoint) as client:
                return {kv.key.rsplit("/", 1)[-1] for kv in client.get_prefix(keys.nodes)[0]}

        wait_until(lambda: "s1" in registered(), 60, "the spare registered", [spare])
        children = [c.pid for c in psutil.Process(spare.pid).children(recursive=True)]
        os.kill(spare.pid, signal.SIGTERM)
        assert spare.wait(60) == 0, spare.output()[-3000:]
        assert "stopped by SIGTERM before its workers started" in spare.output()
        assert "s1" not in registered()  # it left the rendezvous (its record and lease), not by expiry
        assert os.path.exists(os.path.join(earlier, "kept"))  # it wrote nothing there, so it removes nothing
        wait_until(lambda: all(gone(pid) for pid in children), 30, "the spare's processes gone", [spare])
        assert steps_at_world(tmp_path, "m1", 1) > 3 and member.popen.poll() is None  # the run goes on
    finally:
        shutil.rmtree(os.path.join(NODE_MEMORY, run_id), ignore_errors=True)
