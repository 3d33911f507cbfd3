"""The job every netns scenario runs on its hosts (`ermrun` in each host's namespace), and the checks each
one ends with. Two workers, one JSON line per step each in <tmp>/progress/<node>-<local rank>.jsonl, both
stopping after the same step once <tmp>/progress/stop exists:
- "steps" (tests/workers/steps.py): one gloo all_reduce a step, short enough for CI;
- "dlrm" (examples/dlrm/train.py, paced as the soak runs it, flash checkpoints every 10 steps): on top of
  the rounds, the exactly-once checks: at every restart the sample ledger's (no sample lost or doubled) and
  the final state equal, bit for bit, to the replay of the run's world-size schedule without faults
  (tests/chaos/test_soak.py's reference).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from elastic_rm.checkpoint.node_memory import run_memory_dir
from elastic_rm.demo.checks import checks, lineage
from elastic_rm.demo.harness import DEFAULT_SCRIPT, jsonl_rows
from elastic_rm.demo.summary import world_reached
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord
from tests.chaos.helpers import round_record, round_records
from tests.chaos.test_soak import replay
from tests.conftest import Proc
from tests.e2e.exits import exit_codes
from tests.e2e.helpers import STEPS, wait_until
from tests.ermrun_argv import ermrun_argv, flags, node_args
from tests.netns.hosts import Host, Network


@dataclass(frozen=True)
class Outage:
    took: float  # seconds from the cut until the rest trained (a bounded wait)
    back: float  # seconds from the heal until the whole world trained again
    during: RoundRecord | None  # the round while the fault was on
    registered: set[str]  # the node ids registered in etcd then


# A scenario's `worker` parameter: the steps worker in CI, the DLRM slow (70-90 s a scenario on 2 cores,
# the replay included, against 18-33 s).
SLOW = pytest.mark.slow
WORKERS = ["steps", pytest.param("dlrm", marks=SLOW)]
LEASE_TTL = {"steps": 2, "dlrm": 3}  # the DLRM's workers starve a 2 s lease on a loaded 2-core machine
SCRIPTS = {
    "steps": [STEPS],
    "dlrm": [DEFAULT_SCRIPT, "--checkpoint-every", "10", "--pace", "5", "--checksum-every", "10"],
}


class Job:
    """`ermrun` hosts of one run and one worker. Every process is stopped by its id on close."""

    def __init__(
        self,
        worker: str,
        tmp_path,
        run_id: str,
        nnodes: str = "2:3",
        conf: str = "",
        lease_ttl: int | None = None,
    ) -> None:
        """`conf`: more --rdzv-conf settings (",key=value...")."""
        self.worker, self.tmp_path, self.run_id = worker, tmp_path, run_id
        self.nnodes, self.conf = nnodes, conf
        self.lease_ttl = LEASE_TTL[worker] if lease_ttl is None else lease_ttl
        self.progress_dir = str(tmp_path / "progress")
        self.keys = Keyspace("/elastic-rm", run_id)
        self.nodes: dict[str, Proc] = {}
        os.makedirs(self.progress_dir, exist_ok=True)

    def start(self, host: Host, endpoint: str) -> None:
        conf = f"lease_ttl={self.lease_ttl},last_call_timeout=0.5,join_timeout=120{self.conf}"
        argv = ermrun_argv(
            *node_args(endpoint, self.run_id, self.nnodes, host.name, conf),
            *SCRIPTS[self.worker],
            *flags(progress_dir=self.progress_dir, checkpoint_dir=self.tmp_path / "ckpt"),
            monitor_interval=0.1,
            max_restarts=3,
            local_addr=host.addr,
            membership_grace=60,
        )
        env = {
            "STEPS_DIR": self.progress_dir,
            "STEPS_NODE": host.name,
            "STEPS_MAX": "0",
            "GLOO_SOCKET_IFNAME": "eth0",
            "OMP_NUM_THREADS": "1",
        }
        self.nodes[host.name] = Proc(host.argv(argv), str(self.tmp_path / f"{host.name}.log"), env=env)

    def start_all(self, client: EtcdClient, hosts: list[Host], endpoints: list[str]) -> RoundRecord:
        """Host i against endpoints[i]; returns the round once all of them train in it."""
        for host, endpoint in zip(hosts, endpoints, strict=True):
            self.start(host, endpoint)
        self.wait_world(len(hosts), 0.0, f"{len(hosts)} hosts training", 240)
        if self.worker == "dlrm":  # a fault before the first commit would leave no restore to check
            wait_until(
                lambda: any("committed_step" in r for r in self.rows()),
                120,
                "a checkpoint committed",
                self.nodes.values(),
            )
        first = current_round(client, self.keys)
        assert first is not None and len(first.members) == len(hosts), first
        return first

    def leader(self, client: EtcdClient) -> str:
        return client.get(self.keys.leader).value.decode()

    def rows(self) -> list[dict]:
        names = sorted(f for f in os.listdir(self.progress_dir) if f.endswith(".jsonl"))
        return [row for f in names for row in jsonl_rows(os.path.join(self.progress_dir, f))]

    def wait_world(self, world: int, since: float, what: str, timeout: float, steps: int = 5) -> float:
        """Seconds until `steps` steps of a `world`-rank group ran after `since` (a bounded wait)."""
        return wait_until(
            lambda: world_reached(self.rows(), world, since, steps), timeout, what, self.nodes.values()
        )

    def outage(
        self,
        client: EtcdClient,
        cut: Callable[[], None],
        heal: Callable[[], None],
        world: int,
        hold_s: float,
        full: int = 3,
    ) -> Outage:
        """Cut; wait until the rest train at `world`; keep the fault on until `hold_s` after the cut and
        read the run's round and nodes then; heal; wait until the job trains at `full` again."""
        cut()
        t_cut = time.time()
        took = self.wait_world(world, t_cut, f"the rest training at world {world} after the cut", 90)
        time.sleep(max(0.0, hold_s - (time.time() - t_cut)))
        during = current_round(client, self.keys)
        registered = {self.keys.node_of(kv.key) for kv in client.get_prefix(self.keys.nodes)[0]}
        heal()
        t_heal = time.time()
        back = self.wait_world(full, t_heal, f"world {full} again after the heal", 180)
        return Outage(took, back, during, registered)

    def steps(self, world: int, t0: float, t1: float) -> int:
        return len(
            {r["step"] for r in self.rows() if r.get("world") == world and "step" in r and t0 <= r["t"] < t1}
        )

    def output(self, name: str) -> str:
        return self.nodes[name].output()

    def finish(self, client: EtcdClient, timeout: float = 300) -> dict:
        """Read the run's rounds, stop the job (the stop file), and check what every scenario ends with:
        each round's record exists once, written unsealed then sealed at most (none lost or doubled), and
        every agent exits 0. Returns the last round's record."""
        recs = round_records(client, self.run_id)  # rounds/<n>/record: the round key's history is compacted
        final = round_record(client, self.run_id)
        open(os.path.join(self.progress_dir, "stop"), "w").close()
        codes = exit_codes(self.nodes, timeout)
        assert final is not None and sorted(recs) == list(range(1, final["round"] + 1)), (sorted(recs), final)
        assert all(r["_version"] <= 2 for r in recs.values()), recs
        assert set(codes.values()) == {0}, {n: p.output()[-3000:] for n, p in self.nodes.items()}
        return final

    def exactly_once(self, worlds: set[int], restarted: bool) -> str:
        """The DLRM's exactly-once checks (nothing to check for the steps worker, which has no state):
        the ledger's checks at every restart pass (one ran at least, when the scenario `restarted`
        workers), the final state went through `worlds` and equals the replay of its world-size
        schedule. Returns what was checked, for the test's print."""
        if self.worker != "dlrm":
            return "steps worker: rounds and exits checked"
        rows = self.rows()
        ledger = checks(rows)
        assert ledger and all(c["ok"] for c in ledger), [c for c in ledger if not c["ok"]]
        assert not restarted or any("(ledger)" in c["what"] for c in ledger), ledger
        end = [r for r in rows if r.get("end") and r.get("rank") == 0][-1]
        schedule = lineage(rows)
        assert {w for w, _, _ in schedule} >= worlds, schedule
        assert schedule[0][1] == 1 and schedule[-1][2] == end["final_step"], schedule
        reference = replay(self.tmp_path, schedule)
        assert end["checksum"] == reference["checksum"], (end, reference)
        return f"schedule {schedule}; {len(ledger)} ledger checks; checksum {end['checksum']} = the replay's"

    def __enter__(self) -> Job:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for p in self.nodes.values():
            p.stop()
        shutil.rmtree(run_memory_dir(self.run_id), ignore_errors=True)


@contextmanager
def on_hosts(
    n: int, worker: str, tmp_path, run_id: str, etcd_args: tuple[str, ...] = (), **job_args
) -> Iterator[tuple[Network, str, EtcdClient, Job]]:
    """`n` hosts, one etcd on their bridge (its endpoint), a client of it, and the job (not started yet)."""
    with (
        Network(n) as net,
        EtcdCluster(size=1, host=net.gateway, extra_args=list(etcd_args)) as cluster,
        EtcdClient(cluster.endpoint, timeout=5) as client,
        Job(worker, tmp_path, run_id, **job_args) as job,
    ):
        try:
            yield net, cluster.endpoint, client, job
        except BaseException:
            print(f"etcd at the failure:\n{cluster.post_mortem()}")  # a refused connection: did etcd die?
            raise


def current_round(client: EtcdClient, keys: Keyspace) -> RoundRecord | None:
    kv = client.get(keys.round)
    return None if kv is None else RoundRecord.parse(kv.key, kv.value)
