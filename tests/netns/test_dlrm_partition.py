"""The example DLRM (examples/dlrm/train.py, paced as the soak runs it) on three hosts of their own
(network namespaces, see hosts.py), one member host's link down for four leases while etcd compacts,
then up with its connections reset. Beyond the rounds: the sample ledger's checks at every restart (no
sample lost or doubled) and the final state equal, bit for bit, to the replay of the run's world-size
schedule without faults (the soak's reference, tests/chaos/test_soak.py)."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from elastic_rm.demo.checks import checks, lineage
from elastic_rm.demo.harness import DEFAULT_SCRIPT, Demo
from elastic_rm.demo.summary import world_reached
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.train.paths import run_memory_dir
from elastic_rm.wire.keyspace import Keyspace
from tests.chaos.helpers import round_record, round_records
from tests.chaos.test_soak import replay, wait_rows
from tests.netns.hosts import Network, why_unavailable
from tests.netns.test_partitions import COMPACTION

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

LEASE_TTL = 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_dlrm_hosts_a_member_cut_off_and_back_lose_and_double_no_sample(tmp_path):
    demo = Demo(
        workdir=str(tmp_path),
        script=DEFAULT_SCRIPT,
        script_args=["--checkpoint-every", "10", "--pace", "5", "--checksum-every", "10"],
        nnodes="2:3",
        lease_ttl=LEASE_TTL,
        agent_args=["--membership-grace", "60"],
    )
    keys = Keyspace("/elastic-rm", demo.run_id)
    try:
        with (
            Network(3) as net,
            EtcdCluster(size=1, host=net.gateway, extra_args=COMPACTION) as cluster,
            EtcdClient(cluster.endpoint, timeout=5) as client,
        ):
            for h in net.hosts:
                demo.start_node(h.name, cluster.endpoint, extra=["--local-addr", h.addr],
                                prefix=h.argv([]), env={"GLOO_SOCKET_IFNAME": "eth0"})  # fmt: skip
            wait_rows(demo, lambda rows: world_reached(rows, 3, 0.0, 10), 240, "3 hosts training")
            leader = client.get(keys.leader).value.decode()
            cut = next(h for h in net.hosts if h.name != leader)
            cut.link_down()
            t_cut = time.time()
            took = wait_rows(demo, lambda rows: world_reached(rows, 2, t_cut, 5), 90, "the rest at world 2")
            time.sleep(max(0.0, 4 * LEASE_TTL - (time.time() - t_cut)))
            cut.link_up()
            cut.reset_connections()
            t_heal = time.time()
            back = wait_rows(
                demo, lambda rows: world_reached(rows, 3, t_heal, 10), 180, "world 3 after the heal"
            )
            recs = round_records(client, demo.run_id)  # the round key's history is compacted away
            final = round_record(client, demo.run_id)
            open(os.path.join(demo.progress_dir, "stop"), "w").close()
            codes = {n: node.proc.wait(300) for n, node in demo.nodes.items()}
    finally:
        demo.stop_all()
        shutil.rmtree(run_memory_dir(demo.run_id), ignore_errors=True)
    assert sorted(recs) == list(range(1, final["round"] + 1)), sorted(recs)  # no round lost or doubled
    assert all(r["_version"] <= 2 for r in recs.values()), recs  # written unsealed, then sealed, at most
    assert final is not None and sorted(final["members"]) == sorted(
        [*(h for h in ("h0", "h1", "h2") if h != cut.name), f"{cut.name}-r1"]
    )
    assert codes == {"h0": 0, "h1": 0, "h2": 0}, codes
    rows = demo.progress()
    ledger = checks(rows)
    assert ledger and all(c["ok"] for c in ledger), [c for c in ledger if not c["ok"]]
    assert any("(ledger)" in c["what"] for c in ledger)  # the sample-identity check ran at a restart
    end = [r for r in rows if r.get("end") and r.get("rank") == 0][-1]
    schedule = lineage(rows)
    assert {w for w, _, _ in schedule} >= {2, 3}, schedule  # the final state went through both worlds
    reference = replay(tmp_path, schedule)
    assert end["checksum"] == reference["checksum"], (end, reference)
    print(
        f"\n{cut.name} cut off: world 2 {took:.1f}s after the cut, world 3 {back:.1f}s after the heal; "
        f"schedule {schedule}; {len(ledger)} ledger checks; checksum {end['checksum']} = the replay's"
    )
