"""Starting `erm launch --slurm` against the test cluster, and reading what it did."""

from __future__ import annotations

import json
import os
import time

import psutil

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.executor import ExecutorConfig
from elastic_rm.launch.pool import HostPool
from elastic_rm.launch.slurm_cli import Slurm
from elastic_rm.launch.slurm_job import SlurmOptions
from elastic_rm.launch.slurm_nodes import SlurmExecutor
from elastic_rm.obs.events import EventLog, read_etcd
from elastic_rm.wire.keyspace import Keyspace
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import records

WORKER = os.path.join("tests", "launch", "worker.py")  # relative to --workdir (the repository)
CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"


def tool_env(tmp_path, name: str, body: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` with a shell script of ``body`` as ``name`` first on PATH (in ``tmp_path``/bin): a stand-in
    for one of Slurm's commands (or the node jobs' python)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text("#!/bin/sh\n" + body)
    tool.chmod(0o755)
    return {**env, "PATH": f"{bin_dir}:{env['PATH']}"}


def launch(
    tmp_path,
    cluster,
    etcd,
    run_id,
    nnodes: str,
    steps_max: int = 0,
    extra=(),
    log="launch.log",
    script=(WORKER,),
    env=None,
    prefix=(),
) -> Proc:
    argv = [
        *prefix,  # e.g. nohup
        os.path.join(BIN, "erm"),
        "launch",
        "--slurm",
        "--slurm-output",
        str(tmp_path / "%x-%j.out"),
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
        *script,
    ]
    return Proc(argv, str(tmp_path / log), env=env or cluster.env(), cwd=str(tmp_path))


def run_events(etcd, run_id) -> list:
    """Every event of the run in etcd (the launcher's, the leader's, the agents'), oldest first."""
    with EtcdClient(etcd.endpoint) as client:
        events, errors, _ = read_etcd(client, Keyspace("/elastic-rm", run_id))
    assert errors == []
    return events


def launch_events(etcd, run_id) -> list:
    return [e for e in run_events(etcd, run_id) if e.kind == "launch"]


def told(events, kinds=("launch", "demand", "round", "leader")) -> str:
    """The events an assertion judged, one a line, for its message: a failure shows what happened."""
    return "\n".join(
        f"{e.time:.3f} {e.node or '-'} {e.kind}/{e.data.get('action', '')}: {e.message}"
        for e in events
        if e.kind in kinds
    )


def actions(events, action: str) -> list:
    return [e.data for e in events if e.data.get("action") == action]


def run_jobs(cluster, run_id) -> list[dict]:
    return [j for j in cluster.jobs() if j["name"] == f"erm-{run_id}"]


def agents_pids(tmp_path, nodes) -> list[int]:
    return [r["pid"] for n in nodes for r in records(tmp_path, n) if r.get("start")]


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def queue_record(etcd, run_id) -> dict | None:
    with EtcdClient(etcd.endpoint) as client:
        kv = client.get(Keyspace("/elastic-rm", run_id).queue)
    return json.loads(kv.value) if kv is not None else None


def run_options(run_id: str, partition: str | None = None) -> SlurmOptions:
    """A run's node-job options for tests that use only its names (job name, comments) and partition."""
    return SlurmOptions(
        run_id=run_id,
        partition=partition,
        sbatch_args=(),
        exclude=(),
        output="/dev/null",
        workdir="/",
        python="/usr/bin/python3",
        ermrun_flags=(),
        script=("train.py",),
    )


def sleeper_executor(
    client,
    cluster,
    run_id: str,
    tmp_path,
    request: int,
    nodes: int = 6,
    body: str = "exec sleep 300",
    say=lambda message: None,
    slurm=None,
    call_in: bool = False,
    clock=time.monotonic,
) -> SlurmExecutor:
    """The Slurm executor of a run on ``cluster``, driven by the test's calls to tick(); its node jobs'
    batch script only sleeps (what ermrun would do in them does not matter to Slurm's queue), or runs
    ``body`` (a shell script) instead. ``slurm``: Slurm's commands (default: the cluster's); ``call_in``:
    erm launch's --call-in; ``clock``: the executor's (a test moves it past a bound)."""
    sleeper = tmp_path / "python"  # stands in for the python that would run ermrun: the job just holds
    sleeper.write_text(f"#!/bin/sh\n{body}\n")
    sleeper.chmod(0o755)
    keys = Keyspace("/elastic-rm", run_id)
    options = SlurmOptions(
        run_id=run_id,
        partition="debug",
        sbatch_args=(),
        exclude=(),
        output=str(tmp_path / "%j.out"),
        workdir=str(tmp_path),
        python=str(sleeper),
        ermrun_flags=(),
        script=("train.py",),
        requested_nodes=request,
        call_in=call_in,
    )
    events = EventLog(run_id, "erm-launch", client=client, keys=keys)
    return SlurmExecutor(
        client,
        keys,
        HostPool(),
        slurm or Slurm(env=cluster.env()),
        options,
        events,
        ExecutorConfig(1, nodes, exit_grace_s=60),
        say,
        partitions=("debug",),
        clock=clock,
    )


def squeue_jobs(cluster) -> dict[str, dict]:
    """Job id -> name, state, nice, priority, pending reason, comment."""
    r = cluster.cmd("squeue", "-h", "-o", "%i|%j|%T|%y|%Q|%r|%k")
    out = {}
    for line in r.stdout.splitlines():
        job_id, name, state, nice, prio, reason, comment = line.split("|", 6)
        out[job_id] = {
            "name": name,
            "state": state,
            "nice": int(nice),
            "prio": int(prio),
            "reason": reason,
            "comment": comment,
        }
    return out


def sbatch_other(cluster, name: str, nodes: int, partition: str | None = None, extra=()) -> str:
    """Another user's job of ``nodes`` whole nodes that sleeps; its id. ``extra``: more sbatch options."""
    r = cluster.cmd(
        "sbatch",
        "--parsable",
        *(["-p", partition] if partition else []),
        "-N",
        str(nodes),
        "--exclusive",
        *extra,
        "-J",
        name,
        "-o",
        "/dev/null",
        "--wrap",
        "sleep 300",
    )
    return r.stdout.strip().split(";")[0]


def wait_state(cluster, job_id: str, state: str) -> None:
    deadline = time.monotonic() + 30
    while squeue_jobs(cluster).get(job_id, {}).get("state") != state:
        assert time.monotonic() < deadline, f"job {job_id} not {state}: {squeue_jobs(cluster)}"
        time.sleep(0.1)
