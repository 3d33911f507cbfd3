"""Real network faults between hosts (Linux network namespaces on one machine, see hosts.py): three
`ermrun` hosts of the steps worker, etcd on the bridge with auto-compaction every 2 s (a small retention,
as a busy cluster would reach), one host's link down for four leases, then up again with its TCP
connections reset (as a stateful firewall or NAT on the path that forgot them would). Without the
compacted-watch resync (elastic_rm/etcd/watch.py) the host never rejoined: its view stayed at the round
it was cut off in."""

from __future__ import annotations

import os
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord
from tests.conftest import BIN, Proc
from tests.launcher.helpers import STEPS, steps_at_world, wait_until
from tests.netns.hosts import Host, Network, why_unavailable

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

LEASE_TTL = 2
COMPACTION = ["--auto-compaction-mode", "periodic", "--auto-compaction-retention", "2s"]


def start_host(host: Host, endpoint: str, run_id: str, tmp_path, nnodes: str = "2:3") -> Proc:
    argv = [
        os.path.join(BIN, "ermrun"), "--monitor-interval", "0.1", "--nnodes", nnodes, "--nproc-per-node", "1",
        "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--node-id", host.name, "--local-addr", host.addr,
        "--rdzv-conf", f"lease_ttl={LEASE_TTL},last_call_timeout=0.5,join_timeout=120",
        "--membership-grace", "60", STEPS,
    ]  # fmt: skip
    env = {
        "STEPS_DIR": str(tmp_path),
        "STEPS_NODE": host.name,
        "STEPS_MAX": "0",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    return Proc(host.argv(argv), str(tmp_path / f"{host.name}.log"), env=env)


def current_round(client: EtcdClient, keys: Keyspace) -> RoundRecord | None:
    kv = client.get(keys.round)
    return None if kv is None else RoundRecord.parse(kv.key, kv.value)


@pytest.mark.parametrize("role", ["member", "leader"])
def test_a_host_cut_off_past_its_lease_while_etcd_compacts_rejoins(role, run_id, tmp_path, procs):
    """role: the host cut off is the run's leader node (its election key goes with its lease; another
    host leads) or another member."""
    keys = Keyspace("/elastic-rm", run_id)
    with (
        Network(3) as net,
        EtcdCluster(size=1, host=net.gateway, extra_args=COMPACTION) as cluster,
        EtcdClient(cluster.endpoint, timeout=5) as client,
    ):
        nodes = {h.name: start_host(h, cluster.endpoint, run_id, tmp_path) for h in net.hosts}
        procs.extend(nodes.values())
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, 3) > 5 for n in nodes),
            180,
            "3 hosts training",
            nodes.values(),
        )
        before = current_round(client, keys)
        assert before is not None and len(before.members) == 3
        leader = client.get(keys.leader).value.decode()
        cut = next(h for h in net.hosts if (h.name == leader) == (role == "leader"))
        rest = sorted(h.name for h in net.hosts if h is not cut)
        cut.link_down()
        t_cut = time.time()
        took = wait_until(
            lambda: all(steps_at_world(tmp_path, n, 2, since=t_cut) > 3 for n in rest),
            60,
            f"{rest} training at world 2",
            nodes.values(),
        )
        time.sleep(max(0.0, 4 * LEASE_TTL - (time.time() - t_cut)))  # cut off for 4 leases at least
        down_s = time.time() - t_cut
        cut.link_up()
        cut.reset_connections()  # its connection state is gone: watches must start again from a revision
        t_heal = time.time()
        back = wait_until(
            lambda: all(steps_at_world(tmp_path, n, 3, since=t_heal) > 3 for n in nodes),
            90,
            "all three hosts at world 3 again",
            nodes.values(),
        )
        after = current_round(client, keys)
        new_leader = client.get(keys.leader).value.decode()
        (tmp_path / "stop").touch()
        codes = {n: p.wait(120) for n, p in nodes.items()}
    assert after is not None and after.round > before.round + 1
    assert sorted(after.members) == sorted([*rest, f"{cut.name}-r1"]), after.members  # old id never returns
    assert (new_leader in rest) if role == "leader" else (new_leader == leader), (leader, new_leader)
    assert codes == {"h0": 0, "h1": 0, "h2": 0}, {n: p.output()[-2000:] for n, p in nodes.items()}
    assert "is compacted" in nodes[cut.name].output()  # the scenario did reach the compacted-watch path
    print(
        f"\n{role} {cut.name} cut off {down_s:.1f}s (lease {LEASE_TTL}s): {rest} at world 2 {took:.1f}s "
        f"after the cut; all at world 3 {back:.1f}s after the heal; rounds {before.round} -> {after.round}; "
        f"leader {leader} -> {new_leader}"
    )
