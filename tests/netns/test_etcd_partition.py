"""The etcd member holding the raft leadership partitioned from a 3-member cluster, each member a host of
its own (etcd_hosts.py), three `ermrun` hosts of the steps worker on the same bridge. Each job host lists
the members in a different order, so one agent's connection is to the member that is cut off (it must
fail over) and two are to followers (they see only the election)."""

from __future__ import annotations

import os
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.keyspace import Keyspace
from tests.conftest import BIN, Proc
from tests.launcher.helpers import STEPS, steps_at_world, wait_until
from tests.netns.etcd_hosts import NetnsEtcd
from tests.netns.hosts import Host, Network, why_unavailable
from tests.netns.test_partitions import current_round

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

LEASE_TTL = 3
ETCD_TIMEOUT = 1


def start_host(host: Host, endpoints: list[str], run_id: str, tmp_path) -> Proc:
    argv = [
        os.path.join(BIN, "ermrun"), "--monitor-interval", "0.1", "--nnodes", "2:3", "--nproc-per-node", "1",
        "--rdzv-endpoint", ",".join(endpoints), "--rdzv-id", run_id, "--node-id", host.name,
        "--local-addr", host.addr, "--membership-grace", "60",
        "--rdzv-conf", f"lease_ttl={LEASE_TTL},last_call_timeout=0.5,join_timeout=120,etcd_timeout={ETCD_TIMEOUT}",
        STEPS,
    ]  # fmt: skip
    env = {
        "STEPS_DIR": str(tmp_path),
        "STEPS_NODE": host.name,
        "STEPS_MAX": "0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    return Proc(host.argv(argv), str(tmp_path / f"{host.name}.log"), env=env)


def test_the_raft_leader_member_partitioned_from_a_3_member_cluster(run_id, tmp_path, procs):
    keys = Keyspace("/elastic-rm", run_id)
    with Network(6) as net, NetnsEtcd(net.hosts[:3], str(tmp_path)) as etcd:
        jobs = net.hosts[3:]
        eps = etcd.endpoints
        nodes = {h.name: start_host(h, eps[k:] + eps[:k], run_id, tmp_path) for k, h in enumerate(jobs)}
        procs.extend(nodes.values())
        wait_until(lambda: all(steps_at_world(tmp_path, n, 3) > 5 for n in nodes), 180, "3 hosts training",
                   nodes.values())  # fmt: skip
        with EtcdClient(etcd.endpoint, timeout=5) as client:
            before = current_round(client, keys)
        assert before is not None and len(before.members) == 3
        lead = etcd.wait_leader(10)
        on_cut = jobs[lead].name  # the job host whose first endpoint is the cut member
        etcd.hosts[lead].link_down()
        t_cut = time.time()
        rest = [i for i in range(3) if i != lead]
        new_lead = etcd.wait_leader(10, among=rest)
        elected = time.time() - t_cut
        took = wait_until(
            lambda: all(steps_at_world(tmp_path, n, 3, since=t_cut + LEASE_TTL + 2) > 5 for n in nodes),
            LEASE_TTL + 30, "all three hosts training at world 3 after the cut", nodes.values(),
        )  # fmt: skip
        with EtcdClient([eps[i] for i in rest], timeout=5) as client:
            during = current_round(client, keys)
        time.sleep(2)
        etcd.hosts[lead].link_up()
        t_heal = time.time()
        etcd.wait_leader(30)  # the cut member follows again: all three agree
        rejoined = time.time() - t_heal
        wait_until(lambda: all(steps_at_world(tmp_path, n, 3, since=time.time() - 1) > 0 for n in nodes), 30,
                   "training after the heal", nodes.values())  # fmt: skip
        with EtcdClient(etcd.endpoint, timeout=5) as client:
            after = current_round(client, keys)
        (tmp_path / "stop").touch()
        codes = {n: p.wait(120) for n, p in nodes.items()}
    assert new_lead != lead
    assert during is not None and after is not None
    assert sorted(after.members) == sorted(before.members), (before, during, after)
    assert "switching to endpoint" in nodes[on_cut].output()  # its agent did fail over to a follower
    assert codes == {h.name: 0 for h in jobs}, {n: p.output()[-2000:] for n, p in nodes.items()}
    print(
        f"\nraft leader member {lead} cut off: new leader {new_lead} in {elected:.1f}s; all 3 hosts at world 3 "
        f"{took:.1f}s after the cut (lease {LEASE_TTL}s); rounds {before.round} -> {during.round} -> "
        f"{after.round}; the member followed again {rejoined:.1f}s after the heal; {on_cut} used that member"
    )
