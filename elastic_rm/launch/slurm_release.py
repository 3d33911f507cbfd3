"""`ermrun --slurm-release`: inside a fixed Slurm allocation (`sbatch -N 8` + `srun ermrun`), give a node the
run no longer uses back to Slurm by shrinking the allocation (``scontrol update JobId=J NodeList=...``).

Every few seconds each node reads the run: when the leader's demand is below the nodes registered, the
spare nodes (neither members of the current round nor kept as standby) that exceed the demand release
themselves, the last by name first, so that nodes agree without talking. Such a node's agent leaves as on
SIGTERM (its workers stopped, its lease revoked; it is no member, so the round goes on), then shrinks the
allocation by its node, and Slurm ends its task. A node given back cannot return to this allocation, and
srun reports the ended task when the step ends (a non-zero exit status).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..wire.keyspace import Keyspace
from ..wire.records import DemandRecord, RecordError, RoundRecord

log = logging.getLogger(__name__)
CHECK_EVERY_S = 2.0
GIVE_BACK_S = 30.0  # how long a refused shrink of the allocation is tried again
GIVE_BACK_RETRY_S = 3.0


def should_release(
    node_id: str, demand: DemandRecord | None, rnd: RoundRecord | None, registered, stays=frozenset()
) -> bool:
    """Whether this node is one of the spares beyond the demand (the same answer on every node); nodes in
    ``stays`` (the batch script's, which Slurm cannot take from the job) are never given back."""
    if demand is None or demand.target_nodes <= 0 or rnd is None or not rnd.sealed:
        return False
    keep = set(rnd.members) | set(rnd.standby) | set(stays)
    if node_id in keep or node_id not in registered:
        return False
    spares = sorted(n for n in registered if n not in keep)
    surplus = len(registered) - demand.target_nodes
    return surplus > 0 and node_id in spares[len(spares) - min(surplus, len(spares)) :]


def _run(argv: list[str], cwd: str | None = None) -> str:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL, cwd=cwd)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {(r.stderr or r.stdout).strip()[-300:]}")
    return r.stdout


class AllocationRelease(threading.Thread):
    def __init__(
        self,
        client: EtcdClient,
        keys: Keyspace,
        node_id: str,
        job_id: str,
        slurm_node: str,
        every_s: float = CHECK_EVERY_S,
    ):
        super().__init__(name="slurm-release", daemon=True)
        self._client, self._keys, self.node_id = client, keys, node_id
        self.job_id, self.slurm_node, self.every_s = job_id, slurm_node, every_s
        self._stop = threading.Event()
        self._warned = ""
        self.batch_host: str | None = None
        self.keep: list[str] = []  # the allocation's nodes without this one, once it decided to leave

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if self._check():
                    return
            except (EtcdError, RecordError, RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                if str(exc) != self._warned:
                    self._warned = str(exc)
                    log.warning("--slurm-release: %s (this node stays in the allocation)", exc)

    def _check(self) -> bool:
        """True when the thread is done: the run closed, or this node was given back."""
        keys = self._keys
        if self._client.get(keys.closed) is not None:
            return True

        def parsed(key, kind):
            kv = self._client.get(key)
            return kind.parse(key, kv.value) if kv is not None else None

        nodes, _ = self._client.get_prefix(keys.nodes)
        registered = {keys.node_of(kv.key) for kv in nodes}
        if self.batch_host is None:  # Slurm refuses to take the batch script's node from the job
            self.batch_host = _run(["squeue", "-h", "-j", self.job_id, "-o", "%B"]).strip()
        if not should_release(
            self.node_id,
            parsed(keys.demand, DemandRecord),
            parsed(keys.round, RoundRecord),
            registered,
            stays={self.batch_host},
        ):
            return False
        keep = self._others()
        if not keep:
            return False
        log.warning(
            "--slurm-release: node %s is a spare beyond the run's demand; it leaves the run, then "
            "gives %s back to Slurm (job %s keeps %s)",
            self.node_id,
            self.slurm_node,
            self.job_id,
            ",".join(keep),
        )
        self.keep = keep
        os.kill(
            os.getpid(), signal.SIGTERM
        )  # the agent leaves as on any SIGTERM: workers stopped, lease revoked
        return True

    def _others(self) -> list[str]:
        """The allocation's other nodes, as Slurm lists them now; empty when this node is not in it or is
        its last one (nothing to give back then)."""
        listed = _run(["squeue", "-h", "-j", self.job_id, "-o", "%N"]).strip()
        hosts = _run(["scontrol", "show", "hostnames", listed]).split()
        keep = [h for h in hosts if h != self.slurm_node]
        return keep if len(keep) < len(hosts) else []

    def give_back(self, limit_s: float = GIVE_BACK_S) -> None:
        """After the agent left: shrink the allocation by this node (Slurm then ends this task). The node
        list is read again right before each try: another spare may have shrunk the allocation since this
        node decided (a list naming a node no longer in the job is refused). A refused shrink (Slurm may
        answer "try again in a bit") is tried again every few seconds, for at most ``limit_s``."""
        if not self.keep:
            return
        # scontrol writes slurm_job_<id>_resize.{sh,csh} into its working directory: not the job's. Slurm
        # may end this task before the directory is removed: it stays in $TMPDIR then.
        scratch = tempfile.mkdtemp(prefix="erm-slurm-release-")
        deadline = time.monotonic() + limit_s
        try:
            while True:
                try:
                    keep = self._others()
                    if not keep:
                        return  # this node is no longer in the job, or the last one: nothing to give back
                    _run(
                        ["scontrol", "update", f"JobId={self.job_id}", f"NodeList={','.join(keep)}"], scratch
                    )
                    self.keep = keep
                    return
                except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
                    if time.monotonic() + GIVE_BACK_RETRY_S > deadline:
                        log.warning("--slurm-release: %s; the node stays in the allocation, idle", exc)
                        return
                    time.sleep(GIVE_BACK_RETRY_S)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)


def start_release(settings, node_id: str | None, environ=os.environ) -> AllocationRelease:
    """The releaser of this node, started; ValueError outside a Slurm job step."""
    job_id, slurm_node = environ.get("SLURM_JOB_ID"), environ.get("SLURMD_NODENAME")
    if not job_id or not slurm_node or environ.get("SLURM_STEP_ID") is None:
        raise ValueError(
            "--slurm-release works inside a Slurm job step (srun ermrun ...); without srun, drop it"
        )
    client = settings.etcd_client()
    release = AllocationRelease(client, settings.keys, node_id or slurm_node, job_id, slurm_node)
    release.start()
    return release
