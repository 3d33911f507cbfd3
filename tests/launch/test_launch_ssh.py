"""`erm launch` end to end: a real sshd on loopback, a real etcd, real ermrun agents and gloo workers.

Every "host" is 127.0.0.1 through the same sshd; the hostfile's alias form (NAME addr=HOST) and the
host:port form make them distinct nodes.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.events import read_etcd
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import DemandRecord, RoundRecord
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import records, steps_at_world, wait_until
from tests.launch.sshd import closed_port

WORKER = os.path.join("tests", "launch", "worker.py")  # relative to --workdir (the repository)
CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"


def launch(tmp_path, sshd, etcd, run_id, hosts: list[str], nnodes: str, steps_max: int, extra=()) -> Proc:
    argv = [
        os.path.join(BIN, "erm"),
        "launch",
        *hosts,
        *sshd.ssh_flags(),
        "--env",
        f"STEPS_DIR={tmp_path}",
        "--env",
        f"STEPS_MAX={steps_max}",
        "--workdir",
        REPO,
        "--poll-interval",
        "0.3",
        "--stop-grace",
        "15",
        "--exit-grace",
        "60",
        *extra,
        "--nnodes",
        nnodes,
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
        WORKER,
    ]
    return Proc(argv, str(tmp_path / "launch.log"), cwd=str(tmp_path))


def hostfile(tmp_path, text: str) -> list[str]:
    path = tmp_path / "hosts"
    path.write_text(text)
    return ["--hostfile", str(path)]


def launch_events(etcd, run_id) -> list:
    with EtcdClient(etcd.endpoint) as client:
        events, errors, _ = read_etcd(client, Keyspace("/elastic-rm", run_id))
    assert errors == []
    return [e for e in events if e.kind == "launch"]


def actions(events, action: str) -> list[str]:
    return [e.data["host"] for e in events if e.data.get("action") == action]


def demand(client: EtcdClient, keys: Keyspace) -> int:
    """The planner's wanted node count in etcd (0 before the leader wrote one)."""
    kv = client.get(keys.demand)
    return DemandRecord.parse(keys.demand, kv.value).target_nodes if kv else 0


def worlds(tmp_path, node: str) -> set[int]:
    return {r["world"] for r in records(tmp_path, node) if r.get("start")}


def test_an_unreachable_host_is_reported_blacklisted_and_the_job_runs_on_the_others(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    hosts = hostfile(
        tmp_path, f"h1 addr=127.0.0.1\nh2 addr=127.0.0.1\nbad addr=127.0.0.1 port={closed_port()}\n"
    )
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "2:3", steps_max=20)
    procs.append(p)
    assert p.wait(240) == 0, p.output()[-4000:]
    out = p.output()
    assert "Connection refused" in out and "host bad blacklisted" in out
    assert worlds(tmp_path, "h1") == worlds(tmp_path, "h2") == {2}
    assert records(tmp_path, "bad") == []
    events = launch_events(etcd, run_id)
    assert actions(events, "blacklist") == ["bad"]
    assert actions(events, "failure") == ["bad", "bad"]  # two failures in a row (--host-failures 2)
    assert sorted(set(actions(events, "start"))) == ["bad", "h1", "h2"]
    failure = next(e for e in events if e.data.get("action") == "failure")
    assert failure.data["rc"] == 255 and "Connection refused" in failure.data["error"]


def test_when_no_selected_host_can_start_a_node_erm_launch_gives_up_naming_each_error(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    down1, down2 = closed_port(), closed_port()
    hosts = hostfile(
        tmp_path,
        f"d1 addr=127.0.0.1 port={down1} gpu=a100\nd2 addr=127.0.0.1 port={down2} gpu=a100\n"
        "ok addr=127.0.0.1 gpu=t4\n",
    )
    p = launch(tmp_path, ssh_hosts, etcd, run_id, [*hosts, "--select", "gpu=a100"], "1:2", steps_max=5)
    procs.append(p)
    assert p.wait(120) == 1, p.output()[-3000:]
    out = p.output()
    assert "no host could start a node; every host is blacklisted" in out
    assert (
        f"d1: ssh to 127.0.0.1:{down1} failed (exit 255)" in out
        and f"port {down2}: Connection refused" in out
    )
    assert sorted(set(actions(launch_events(etcd, run_id), "start"))) == ["d1", "d2"]  # "ok" is not selected


@pytest.mark.slow
def test_a_hostfile_naming_one_machine_three_times_runs_three_nodes_with_their_slots(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    hosts = hostfile(tmp_path, f"h1 addr=127.0.0.1\nh2 addr=127.0.0.1 slots=2\n127.0.0.1:{ssh_hosts.port}\n")
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "3", steps_max=20)
    procs.append(p)
    assert p.wait(240) == 0, p.output()[-4000:]
    third = f"127.0.0.1-{ssh_hosts.port}"
    for node in ("h1", "h2", third):
        assert worlds(tmp_path, node) == {4}, node  # 1 + 2 (slots=2) + 1 workers
        assert sum(1 for r in records(tmp_path, node) if "step" in r) == 20 * (2 if node == "h2" else 1)
    assert sorted(
        r["env"]["ERM_LAUNCH_HOST"]
        for n in ("h1", "h2", third)
        for r in records(tmp_path, n)
        if r.get("start")
    ) == sorted(["h1", "h2", "h2", third])
    out = p.output()
    assert "[h1] " in out and f"[{third}] " in out  # the nodes' logs, prefixed with their host
    assert "job finished" in out


@pytest.mark.slow
def test_discovery_adds_a_host_the_job_scales_to_and_drains_a_host_removed(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    listing = tmp_path / "listing"
    listing.write_text("h1 addr=127.0.0.1\nh2 addr=127.0.0.1\nh3 addr=127.0.0.1\n")
    hosts = ["--discovery-script", f"cat {listing}", "--discovery-interval", "1"]
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "2:4", steps_max=0)
    procs.append(p)
    nodes3 = ("h1", "h2", "h3")
    wait_until(lambda: all(steps_at_world(tmp_path, n, 3) > 3 for n in nodes3), 180, "3 nodes training", [p])

    listing.write_text("h1 addr=127.0.0.1\nh2 addr=127.0.0.1\nh3 addr=127.0.0.1\nh4 addr=127.0.0.1\n")
    nodes4 = (*nodes3, "h4")
    wait_until(lambda: all(steps_at_world(tmp_path, n, 4) > 3 for n in nodes4), 180, "4 nodes training", [p])

    listing.write_text("h1 addr=127.0.0.1\nh3 addr=127.0.0.1\nh4 addr=127.0.0.1\n")
    removed = time.time()
    rest = ("h1", "h3", "h4")
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 3, since=removed) > 3 for n in rest),
        180,
        "3 nodes after the drain",
        [p],
    )
    (tmp_path / "stop").write_text("")
    assert p.wait(180) == 0, p.output()[-4000:]
    events = launch_events(etcd, run_id)
    assert actions(events, "host-added") == ["h4"]
    assert actions(events, "host-removed") == ["h2"]
    stop = next(e for e in events if e.data.get("action") == "stop")
    assert stop.data["host"] == "h2" and "left the discovery output" in stop.data["reason"]
    assert actions(events, "stopped") == ["h2"]
    assert actions(events, "failure") == []
    last_h2 = max(r["t"] for r in records(tmp_path, "h2"))
    assert all(steps_at_world(tmp_path, n, 3, since=last_h2) > 3 for n in rest)


@pytest.mark.slow
def test_the_planners_demand_decides_how_many_hosts_run(etcd, run_id, tmp_path, procs, ssh_hosts):
    # a name of its own: a finished run of the same job in this etcd would warm-start this one at its size
    job = {
        "name": run_id,
        "global_batch": 4096,
        "tables": [{"rows": 1000, "dim": 8}],
        "dense_params": 1000,
        "request": {"nodes": 2},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    hosts = hostfile(tmp_path, "".join(f"h{i} addr=127.0.0.1\n" for i in range(1, 5)))
    extra = ["--job", str(tmp_path / "job.json")]  # an ermrun flag: the leader runs the planner
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "2:4", steps_max=60, extra=extra)
    procs.append(p)
    assert p.wait(240) == 0, p.output()[-4000:]
    events = launch_events(etcd, run_id)
    with EtcdClient(etcd.endpoint) as client:
        first = RoundRecord.parse("record", client.get(Keyspace("/elastic-rm", run_id).record(1)).value)
    # 4 hosts and no demand yet: 4 started. The planner's cold start wants 2; what round 1 neither uses
    # nor keeps as standby is released, and nothing is started again (2 running = the demand).
    assert len(first.members) == 2
    stops = [e for e in events if e.data.get("action") == "stop"]
    assert len(stops) == 4 - 2 - len(first.standby) and len(actions(events, "start")) == 4
    assert all("demand 2" in e.data["reason"] for e in stops)
    released = {e.data["host"] for e in stops}
    assert released.isdisjoint(first.members) and all(records(tmp_path, h) == [] for h in released)
    assert all(worlds(tmp_path, n) == {2} for n in first.members)


@pytest.mark.slow
def test_a_line_added_to_the_hostfile_and_a_second_launcher_grow_a_running_job(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    hosts = hostfile(tmp_path, "h1 addr=127.0.0.1\nh2 addr=127.0.0.1\n")
    a = launch(tmp_path, ssh_hosts, etcd, run_id, [*hosts, "--discovery-interval", "1"], "2:4", steps_max=0)
    procs.append(a)
    wait_until(lambda: all(steps_at_world(tmp_path, n, 2) > 3 for n in ("h1", "h2")), 180, "2 nodes", [a])
    with open(tmp_path / "hosts", "a") as fh:
        fh.write("h3 addr=127.0.0.1\n")
    three = ("h1", "h2", "h3")
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 3) > 3 for n in three), 180, "the added line's node", [a]
    )

    other = tmp_path / "other"
    other.mkdir()
    (other / "hosts").write_text("h4 addr=127.0.0.1\n")
    b = launch(other, ssh_hosts, etcd, run_id, ["--hostfile", str(other / "hosts")], "2:4", steps_max=0)
    procs.append(b)
    # b's node writes its records to b's STEPS_DIR; it counts the 3 nodes of a and starts its one
    wait_until(lambda: steps_at_world(other, "h4", 4) > 3, 180, "the second launcher's node", [a, b])
    (tmp_path / "stop").write_text("")
    (other / "stop").write_text("")
    assert a.wait(180) == 0, a.output()[-4000:]
    assert b.wait(180) == 0, b.output()[-4000:]
    starts = actions(launch_events(etcd, run_id), "start")
    assert sorted(starts) == ["h1", "h2", "h3", "h4"]  # nobody started a node twice or beyond the 4 wanted


@pytest.mark.slow
def test_ctrl_c_stops_every_node_and_leaves_nothing_running(etcd, run_id, tmp_path, procs, ssh_hosts):
    hosts = hostfile(tmp_path, "h1 addr=127.0.0.1\nh2 addr=127.0.0.1\n")
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "2", steps_max=0)
    procs.append(p)
    wait_until(lambda: all(steps_at_world(tmp_path, n, 2) > 3 for n in ("h1", "h2")), 180, "2 nodes", [p])
    agents = {
        r["env"]["ERM_LAUNCH_HOST"]: r for n in ("h1", "h2") for r in records(tmp_path, n) if r.get("start")
    }
    assert set(agents) == {"h1", "h2"}
    os.kill(
        p.pid, signal.SIGINT
    )  # the launcher alone, as a terminal's Ctrl-C would (nodes run in own sessions)
    assert p.wait(120) == 130, p.output()[-3000:]
    assert "interrupted: every node was stopped" in p.output()
    with EtcdClient(etcd.endpoint) as client:
        keys = Keyspace("/elastic-rm", run_id)
        assert client.get_prefix(keys.nodes)[0] == []  # every agent left (revoked its lease)
        assert client.get(keys.closed) is None  # stopped, not finished: the run could be resumed
    sshd = psutil.Process(ssh_hosts.proc.pid)
    wait_until(lambda: sshd.children() == [], 30, "no session left on the hosts (their sshd)", [p])

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    workers = [r["pid"] for r in agents.values()]
    wait_until(lambda: all(gone(pid) for pid in workers), 30, "the workers (own sessions) stopped too", [p])


@pytest.mark.slow
def test_a_discovered_host_gets_a_node_when_the_planners_demand_is_above_the_nodes_running(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    # a name of its own: a finished run of the same job in this etcd would warm-start this one at its size
    job = {
        "name": run_id,
        "global_batch": 4096,
        "tables": [{"rows": 1000, "dim": 8}],
        "dense_params": 1000,
        "request": {"nodes": 4},
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    listing = tmp_path / "listing"
    listing.write_text("h1 addr=127.0.0.1\nh2 addr=127.0.0.1\nh3 addr=127.0.0.1\n")
    hosts = ["--discovery-script", f"cat {listing}", "--discovery-interval", "1"]
    extra = ["--job", str(tmp_path / "job.json")]
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "2:4", steps_max=0, extra=extra)
    procs.append(p)
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as client:
        wait_until(
            lambda: demand(client, keys) == 4 and records(tmp_path, "h1"),
            180,
            "the planner's demand of 4",
            [p],
        )
        listing.write_text("h1 addr=127.0.0.1\nh2 addr=127.0.0.1\nh3 addr=127.0.0.1\nh4 addr=127.0.0.1\n")
        wait_until(lambda: client.get(keys.node("h4")) is not None, 180, "a node on the new host", [p])
    (tmp_path / "stop").write_text("")
    assert p.wait(180) == 0, p.output()[-4000:]
    start = [
        e for e in launch_events(etcd, run_id) if e.data.get("action") == "start" and e.data["host"] == "h4"
    ]
    assert len(start) == 1 and "demand 4" in start[0].data["reason"]


@pytest.mark.slow
def test_the_planner_asks_for_a_node_erm_launch_starts_it_on_a_discovered_host_and_a_scale_up_admits_it(
    etcd, run_id, tmp_path, procs, ssh_hosts
):
    """The whole loop with the planner: it profiles the TorchRec job at 2 nodes, wants 3 (demand), erm launch
    starts a node on the host discovery just found, and the planner's scale-up round admits it."""
    with open(os.path.join(REPO, "examples", "dlrm", "job.json")) as fh:
        job = json.load(fh)
    job["name"] = run_id  # no earlier run's history warm-starts this one
    job["planner"]["round_warmup_s"] = 5
    (tmp_path / "job.json").write_text(json.dumps(job))
    listing = tmp_path / "listing"
    listing.write_text("h1 addr=127.0.0.1\nh2 addr=127.0.0.1\n")
    progress = tmp_path / "progress"
    argv = [
        os.path.join(BIN, "erm"),
        "launch",
        "--discovery-script",
        f"cat {listing}",
        "--discovery-interval",
        "1",
        *ssh_hosts.ssh_flags(),
        "--workdir",
        REPO,
        "--env",
        "OMP_NUM_THREADS=1",
        "--poll-interval",
        "0.3",
        "--stop-grace",
        "15",
        "--exit-grace",
        "90",
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "1",
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        "lease_ttl=3,last_call_timeout=1,join_timeout=120",
        "--job",
        str(tmp_path / "job.json"),
        os.path.join("examples", "dlrm", "train.py"),
        "--progress-dir",
        str(progress),
    ]
    p = Proc(argv, str(tmp_path / "launch.log"), cwd=str(tmp_path))
    procs.append(p)
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as client:

        def round_now() -> RoundRecord | None:
            kv = client.get(keys.round)
            return RoundRecord.parse(keys.round, kv.value) if kv else None

        wait_until(lambda: demand(client, keys) == 3, 300, "the planner's demand for a third node", [p])
        listing.write_text("h1 addr=127.0.0.1\nh2 addr=127.0.0.1\nh3 addr=127.0.0.1\n")
        wait_until(
            lambda: (r := round_now()) is not None and r.sealed and "h3" in r.members,
            300,
            "a round with the discovered host",
            [p],
        )
        admitted = round_now()
    (progress / "stop").write_text("")
    assert p.wait(240) == 0, p.output()[-4000:]
    assert admitted.reason.startswith("scale up 2 -> 3"), admitted.reason
    on_h3 = [e.data for e in launch_events(etcd, run_id) if e.data.get("host") == "h3"]
    starts = [e for e in on_h3 if e["action"] == "start"]
    stops = [e for e in on_h3 if e["action"] == "stop"]
    assert starts and all("demand 3" in e["reason"] for e in starts), on_h3
    # near the payback bar, the planner's demand may fall back to 2 for a sample and rise again (each sample
    # moves its model; docs/launch.md, "The executor"): h3 is then stopped and started again, for nothing else
    assert len(stops) == len(starts) - 1 and all("2 wanted" in e["reason"] for e in stops), on_h3
