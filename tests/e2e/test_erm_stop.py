"""`erm stop RUN` stops a run cleanly (drain, final checkpoint, closed, every agent exits 0, node memory
freed); `erm stop RUN --node N` takes one node down while the run goes on."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import psutil
import pytest

from elastic_rm.checkpoint.node_memory import memory_root
from elastic_rm.etcd.client import EtcdClient
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import records, wait_until
from tests.ermrun_argv import ermrun_argv, node_args

ERM = os.path.join(BIN, "erm")
REPORTING = os.path.join(REPO, "tests", "workers", "reporting.py")
STEPS = os.path.join(REPO, "tests", "workers", "steps.py")


def _node(etcd, run_id: str, tmp_path, name: str, nnodes: str) -> Proc:
    argv = ermrun_argv(*node_args(etcd.endpoint, run_id, nnodes, name), REPORTING, monitor_interval=0.1)
    return Proc(argv, str(tmp_path / f"{name}.log"), env={"STEPS_DIR": str(tmp_path), "STEPS_NODE": name})


def _erm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([ERM, *args], capture_output=True, text=True, timeout=180)


def _steps_at(tmp_path, node: str, world: int) -> int:
    return sum(1 for r in records(tmp_path, node) if "step" in r and r.get("world") == world)


def _two_nodes_at_world_2(start, run_id: str, tmp_path, procs) -> dict[str, Proc]:
    """Nodes a and b (``start(name)``) training at world 2, each with a step in node memory as a flash
    checkpoint leaves it."""
    nodes = {n: start(n) for n in ("a", "b")}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(_steps_at(tmp_path, n, 2) >= 5 for n in nodes),
        120,
        "both nodes at world 2",
        nodes.values(),
    )
    for n in nodes:
        (memory_root() / run_id / n / "step-5").mkdir(parents=True)
        (memory_root() / run_id / n / "step-5" / "shard").write_bytes(b"0" * 4096)
    return nodes


@pytest.mark.slow  # 29 s; CI keeps erm stop of a plain script below (every agent exits 0, node memory freed)
def test_erm_stop_drains_closes_and_every_agent_exits_0(etcd, run_id, tmp_path, procs):
    nodes = _two_nodes_at_world_2(lambda n: _node(etcd, run_id, tmp_path, n, "2"), run_id, tmp_path, procs)

    result = _erm("stop", run_id, "--endpoint", etcd.endpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped: 2 node(s) left (a, b)" in result.stdout
    for p in nodes.values():
        assert p.wait(60) == 0, p.output()[-3000:]
    stopped = {n: [r["stopped_at"] for r in records(tmp_path, n) if "stopped_at" in r] for n in nodes}
    assert len(stopped["a"]) == 1 and stopped["a"] == stopped["b"], stopped  # one final checkpoint, one step
    with EtcdClient(etcd.endpoint) as c:
        closed = json.loads(c.get(f"/elastic-rm/{run_id}/closed").value)
        assert closed["by"] == "erm stop"
        assert c.get_prefix(f"/elastic-rm/{run_id}/nodes/")[0] == []
    assert not (memory_root() / run_id).exists(), sorted((memory_root() / run_id).rglob("*"))
    for p in nodes.values():
        assert "stopped by erm stop" in p.output() and "node memory freed" in p.output()

    again = _erm("stop", run_id, "--endpoint", etcd.endpoint)
    assert again.returncode == 0 and "already closed (by erm stop)" in again.stdout
    bad = _erm("stop", "no-such-run", "--endpoint", etcd.endpoint)
    assert bad.returncode == 2 and "no run 'no-such-run' under /elastic-rm" in bad.stderr
    node = _erm("stop", run_id, "--endpoint", etcd.endpoint, "--node", "zz")
    assert node.returncode == 2 and "no node 'zz' in run" in node.stderr
    wait = _erm("stop", run_id, "--endpoint", etcd.endpoint, "--wait", "-1")
    assert wait.returncode == 2 and "--wait must be >= 0 seconds" in wait.stderr


@pytest.mark.slow
def test_erm_stop_node_takes_one_node_down_and_the_run_goes_on(etcd, run_id, tmp_path, procs):
    nodes = {n: _node(etcd, run_id, tmp_path, n, "1:2") for n in ("a", "b")}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(_steps_at(tmp_path, n, 2) >= 5 for n in nodes),
        120,
        "both nodes at world 2",
        nodes.values(),
    )
    result = _erm("stop", run_id, "--endpoint", etcd.endpoint, "--node", "b")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "node b left run" in result.stdout
    assert nodes["b"].wait(60) == 128 + 15  # stopped by SIGTERM, said without a traceback
    assert "stopped by SIGTERM" in nodes["b"].output() and "Traceback" not in nodes["b"].output()
    wait_until(lambda: _steps_at(tmp_path, "a", 1) >= 5, 120, "node a training alone", nodes.values())
    assert nodes["a"].popen.poll() is None
    (tmp_path / "stop").touch()  # end the run
    assert nodes["a"].wait(60) == 0, nodes["a"].output()[-3000:]


def _plain_node(etcd, run_id: str, tmp_path, name: str) -> Proc:
    """A node of a plain torch script (no elastic-rm API: nothing to drain)."""
    node = node_args(etcd.endpoint, run_id, "2", name)
    argv = ermrun_argv(*node, STEPS, monitor_interval=0.1, drain_grace=3)
    return Proc(argv, str(tmp_path / f"{name}.log"), env={"STEPS_DIR": str(tmp_path), "STEPS_NODE": name})


def test_erm_stop_of_a_plain_script_terminates_its_workers_and_every_agent_exits_0(
    etcd, run_id, tmp_path, procs
):
    nodes = _two_nodes_at_world_2(lambda n: _plain_node(etcd, run_id, tmp_path, n), run_id, tmp_path, procs)
    workers = [r["pid"] for n in nodes for r in records(tmp_path, n) if r.get("start")]

    result = _erm("stop", run_id, "--endpoint", etcd.endpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    for p in nodes.values():
        assert p.wait(60) == 0, p.output()[-3000:]
    for p in nodes.values():
        out = p.output()
        assert "stopped by erm stop" in out and "node memory freed" in out, out[-3000:]
        assert "1 without the API; workers 1 stopped by SIGTERM" in out, out[-3000:]
        assert "Unknown worker" not in out and "job failed" not in out, out[-3000:]
        assert "failed (exitcode" not in out, out[-3000:]  # the stop's own SIGTERM is no failure
    assert workers and not [
        pid
        for pid in workers
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]
    assert not (memory_root() / run_id).exists(), sorted((memory_root() / run_id).rglob("*"))


SHORT_FORM = os.path.join(REPO, "tests", "workers", "short_form.py")


def _api_node(etcd, run_id: str, tmp_path, name: str) -> Proc:
    """A node whose workers use the API (elastic_run: rounds in place, drained at a step boundary)."""
    argv = ermrun_argv(*node_args(etcd.endpoint, run_id, "1:3", name), SHORT_FORM, monitor_interval=0.1)
    return Proc(argv, str(tmp_path / f"{name}.log"), env={"STEPS_DIR": str(tmp_path), "STEPS_NODE": name})


def _rows_at(tmp_path, node: str, world: int, since: float = 0.0) -> int:
    return sum(1 for r in records(tmp_path, node) if r.get("world") == world and r["t"] >= since)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_erm_stop_after_the_leader_was_killed_and_replaced_drains_every_node(
    etcd, run_id, tmp_path, procs, attempt
):
    nodes = {n: _api_node(etcd, run_id, tmp_path, n) for n in ("a", "b", "c")}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(_rows_at(tmp_path, n, 3) >= 5 for n in nodes), 180, "3 nodes training", nodes.values()
    )
    with EtcdClient(etcd.endpoint) as c:
        leader = c.get(f"/elastic-rm/{run_id}/leader").value.decode()
    nodes[leader].signal(signal.SIGKILL)
    killed = time.time()
    survivors = [n for n in nodes if n != leader]
    wait_until(
        lambda: all(_rows_at(tmp_path, n, 2, killed) >= 5 for n in survivors),
        120,
        "survivors at world 2",
        nodes.values(),
    )
    new = _api_node(etcd, run_id, tmp_path, "d")  # the replacement
    procs.append(new)
    live = {**{n: nodes[n] for n in survivors}, "d": new}
    joined = time.time()
    wait_until(
        lambda: all(_rows_at(tmp_path, n, 3, joined) >= 5 for n in live),
        180,
        "back at world 3",
        live.values(),
    )

    result = _erm("stop", run_id, "--endpoint", etcd.endpoint)
    assert result.returncode == 0, result.stdout + result.stderr
    for p in live.values():
        assert p.wait(120) == 0, p.output()[-3000:]
        out = p.output()
        assert re.search(r"erm stop: drained 1 worker\(s\) at step \d+, 0 without the API", out), out[-3000:]
        assert "stopped by erm stop" in out and "Unknown worker" not in out, out[-3000:]
    assert not [n for n in live if (memory_root() / run_id / n).exists()]  # every live node freed its memory
