"""Workers' thread count from the node's CPU share: nodes that share a machine do not oversubscribe it."""

from __future__ import annotations

import os
import subprocess

import pytest

from elastic_rm.agent.threads import choose, usable_cores
from tests.e2e.helpers import STEPS, ermrun, records
from tests.ermrun_argv import ermrun_argv, node_args


def test_the_share_is_the_cpu_limit_else_the_cores_over_the_nodes_here():
    assert choose(1, None, nodes_here=2, cores=8).threads == 4
    assert choose(2, None, nodes_here=2, cores=8).threads == 2
    assert choose(1, None, nodes_here=1, cores=8).threads == 8
    assert choose(1, 3.0, nodes_here=2, cores=8).threads == 3  # --cpu-limit wins over the split
    assert choose(4, 0.5, nodes_here=1, cores=8).threads == 1  # never fewer than one
    assert "2 nodes of the run on this machine" in choose(1, None, 2, 8).why
    with pytest.raises(ValueError, match="at least one worker"):
        choose(0, None, 1, 8)


def test_two_nodes_on_one_machine_split_its_cores(etcd, run_id, tmp_path, procs, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    nodes = [ermrun(tmp_path, n, node_args(etcd.endpoint, run_id, "2", n), steps_max=3) for n in ("a", "b")]
    procs.extend(nodes)
    for p in nodes:
        assert p.wait(120) == 0, p.output()[-3000:]
    want = str(max(1, usable_cores() // 2))
    starts = [r for n in ("a", "b") for r in records(tmp_path, n) if r.get("start")]
    assert len(starts) == 2 and {r["env"]["OMP_NUM_THREADS"] for r in starts} == {want}
    for p in nodes:
        assert f"OMP_NUM_THREADS={want}" in p.output() and "2 nodes of the run on this machine" in p.output()


@pytest.mark.parametrize("user", [None, pytest.param("3", marks=pytest.mark.slow)])  # a job each
def test_a_node_alone_uses_its_cores_and_a_users_value_wins(tmp_path, user):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update({"STEPS_DIR": str(tmp_path), "STEPS_NODE": "s", "STEPS_MAX": "2"})
    if user is not None:
        env["OMP_NUM_THREADS"] = user
    argv = ermrun_argv(STEPS, standalone=True, nproc_per_node=1)
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    starts = [r for r in records(tmp_path, "s") if r.get("start")]
    assert [r["env"]["OMP_NUM_THREADS"] for r in starts] == [user or str(usable_cores())]
    assert ("OMP_NUM_THREADS=" in result.stderr) == (user is None)
