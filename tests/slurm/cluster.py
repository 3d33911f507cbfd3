"""A real Slurm cluster on this machine for the tests: munge, one slurmctld and N slurmd (``slurmd -N bK``,
each node on a port of its own, all at 127.0.0.1), in a private directory (config, state, spool, logs, the
munge key and socket). Every daemon is started in the foreground by us and stopped by its pid.

Needs Debian's ``slurmctld slurmd slurm-client munge`` and root (slurmd runs jobs as their users).
Clients find the cluster through ``SLURM_CONF`` (``env()``), so nothing outside the directory is touched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from elastic_rm.etcd.server import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "sinfo")
SBIN = ("/usr/sbin", "/sbin")
START_TIMEOUT_S = 30.0


def find(binary: str) -> str | None:
    found = shutil.which(binary)
    if found:
        return found
    for d in SBIN:
        path = os.path.join(d, binary)
        if os.access(path, os.X_OK):
            return path
    return None


def why_not() -> str | None:
    """Why this machine cannot run the cluster (None: it can)."""
    missing = [b for b in DAEMONS if find(b) is None]
    if missing:
        return (
            f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd "
            "slurm-client munge"
        )
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as their users)"
    return None


CONF = """\
ClusterName=ermtest
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={dir}/munge.sock
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool-%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.txt
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/linear
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
InactiveLimit=0
KillWait=2
MinJobAge=2
MessageTimeout=5
SchedulerParameters=sched_interval=1
SrunPortRange=60001-63000
{nodes}
PartitionName={partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=other Nodes=ALL Default=NO MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, nodes: int = 4, partition: str = "debug"):
        self.node_names = [f"b{k}" for k in range(1, nodes + 1)]
        self.partition = partition
        self.dir = Path(tempfile.mkdtemp(prefix="erm-slurm-"))
        self.conf = self.dir / "slurm.conf"
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []

    # -- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        try:
            self._munge()
            self._write_conf()
            self._daemon([find("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out")
            for name in self.node_names:
                self._daemon([find("slurmd"), "-D", "-N", name, "-f", str(self.conf)], f"slurmd-{name}.out")
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Every daemon by its pid (slurmd first, munge last), then the directory."""
        for p in reversed(self._procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        for fh in self._logs:
            fh.close()
        self._procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _daemon(self, argv: list, log_name: str) -> subprocess.Popen:
        fh = open(self.dir / log_name, "wb")
        self._logs.append(fh)
        p = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        self._procs.append(p)
        return p

    def _munge(self) -> None:
        key = self.dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.dir.chmod(0o700)
        self._daemon(
            [
                find("munged"),
                "--foreground",
                "--force",
                f"--socket={self.dir}/munge.sock",
                f"--key-file={key}",
                f"--pid-file={self.dir}/munged.pid",
                f"--log-file={self.dir}/munged.log",
                f"--seed-file={self.dir}/munged.seed",
                "--num-threads=2",
            ],
            "munged.out",
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (self.dir / "munge.sock").exists():
            if time.monotonic() > deadline or self._procs[-1].poll() is not None:
                raise RuntimeError(f"munged did not start: {self.log('munged.out')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        lines = [
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} CPUs=1 State=UNKNOWN"
            for n in self.node_names
        ]
        self.conf.write_text(
            CONF.format(
                host="localhost",
                ctld_port=free_port(),
                dir=self.dir,
                nodes="\n".join(lines),
                partition=self.partition,
            )
        )

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            states = self.node_states()
            if states and all(s == "idle" for s in states.values()):
                return
            for p in self._procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode}: {self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"Slurm nodes not idle after {START_TIMEOUT_S:g}s: {states}\n{self.logs()}"
                )
            time.sleep(0.1)

    # -- using it ---------------------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """This process's environment with SLURM_CONF pointing at the cluster (and sbin on PATH)."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        path = env.get("PATH", "")
        env["PATH"] = ":".join([path, *[d for d in SBIN if d not in path.split(":")]])
        return env

    def cmd(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(  # errors="replace": another user's job name need not be UTF-8
            list(argv),
            env=self.env(),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=check,
        )

    def node_states(self) -> dict[str, str]:
        """Node name -> its state as sinfo prints it, lower case, without the flags (idle, alloc, down...)."""
        r = self.cmd("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        out = {}
        for line in r.stdout.splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1].rstrip("*~#!%$@^-").lower()
        return out

    def jobs(self) -> list[dict]:
        """Every job squeue still lists, as {id, name, state, node, comment}."""
        r = self.cmd("squeue", "-h", "-o", "%i|%j|%T|%N|%k", check=False)
        out = []
        for line in r.stdout.splitlines():
            parts = line.split("|")
            if len(parts) == 5:
                out.append(dict(zip(("id", "name", "state", "node", "comment"), parts, strict=True)))
        return out

    def ended_jobs(self) -> dict[str, dict[str, str]]:
        """Slurm's record of every job that ended (its job completion log, jobcomp/filetxt): job id ->
        its fields as Slurm wrote them (``JobState``: COMPLETED, FAILED, CANCELLED...; ``ExitCode``)."""
        try:
            lines = (self.dir / "jobcomp.txt").read_text(errors="replace").splitlines()
        except FileNotFoundError:
            return {}
        out = {}
        for line in lines:
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            if "JobId" in fields:
                out[fields["JobId"]] = fields
        return out

    def reset(self, timeout_s: float = 30.0) -> None:
        """No job left, every node back in service and idle."""
        ids = [j["id"] for j in self.jobs()]
        if ids:
            self.cmd("scancel", *ids, check=False)
        for name, state in self.node_states().items():
            if state.startswith(("down", "drain")):
                self.cmd("scontrol", "update", f"NodeName={name}", "State=RESUME", check=False)
        deadline = time.monotonic() + timeout_s
        while self.jobs() or any(s != "idle" for s in self.node_states().values()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm not idle after {timeout_s:g}s: {self.jobs()} {self.node_states()}")
            time.sleep(0.1)
        # a cancelled job's processes can outlive its listing by a moment (proctrack/linuxproc signals them
        # as slurmctld forgets the job); wait for them, not kill them: one that stays is a leftover the
        # session's check names
        while self.job_processes() and time.monotonic() < deadline:
            time.sleep(0.1)

    def job_processes(self) -> list[psutil.Process]:
        """Processes of this cluster's jobs still alive (by SLURM_JOB_ID and this cluster's SLURM_CONF)."""
        found = []
        for p in psutil.process_iter():
            try:
                env = p.environ()
            except (psutil.Error, OSError):
                continue
            if "SLURM_JOB_ID" in env and env.get("SLURM_CONF") == str(self.conf):
                found.append(p)
        return found

    def log(self, name: str) -> str:
        try:
            return (self.dir / name).read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)}" for n in ("slurmctld.log", "slurmctld.out", "munged.log"))
