"""Packet loss and added delay on real links between hosts (network namespaces, see hosts.py), three
`ermrun` hosts of the steps worker, lease 2 s. This kernel has no sch_netem, so loss is a classic-BPF
filter drawing the kernel's random number into a queue that holds nothing (`hosts.drop_randomly`), and
delay a userspace TCP proxy on the etcd path (`delay_proxy.py`). Neither may cost a lease: the round and
its members stay, and every host trains at world 3 throughout; a stop while the fault is on ends every
agent with status 0."""

from __future__ import annotations

import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdCluster
from elastic_rm.wire.keyspace import Keyspace
from tests.launcher.exits import exit_codes
from tests.launcher.helpers import steps_at_world, wait_until
from tests.netns.delay_proxy import DelayProxy
from tests.netns.hosts import Network, why_unavailable
from tests.netns.test_partitions import current_round, start_host

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

LOSS = 0.05
DELAY_S = 0.1  # each way: 200 ms more round trip to etcd
WINDOW_S = 12  # six leases


def steps_between(tmp_path, node: str, t0: float, t1: float) -> int:
    return steps_at_world(tmp_path, node, 3, since=t0) - steps_at_world(tmp_path, node, 3, since=t1)


# The job is stopped while the loss is still on. An agent used to stay up to 300 s then: the steps worker's
# ranks each looked for the stop file on their own, and one started a step its peers had left (they now
# agree on the stop step; elastic_rm.agent.finish bounds the agents' side).
@pytest.mark.parametrize("fault", ["loss", "delay"])
def test_training_goes_on_through_packet_loss_and_etcd_delay_without_a_lease_lost(
    fault, run_id, tmp_path, procs
):
    keys = Keyspace("/elastic-rm", run_id)
    with (
        Network(3) as net,
        EtcdCluster(size=1, host=net.gateway) as cluster,
        DelayProxy(net.gateway, cluster.endpoint, DELAY_S) as proxy,
        EtcdClient(cluster.endpoint, timeout=5) as client,
    ):
        endpoint = proxy.endpoint if fault == "delay" else cluster.endpoint
        nodes = {h.name: start_host(h, endpoint, run_id, tmp_path) for h in net.hosts}
        procs.extend(nodes.values())
        wait_until(lambda: all(steps_at_world(tmp_path, n, 3) > 5 for n in nodes), 180, "3 hosts training",
                   nodes.values())  # fmt: skip
        before = current_round(client, keys)
        if fault == "loss":
            for h in net.hosts:
                h.lossy(LOSS)
        t0 = time.time()
        time.sleep(WINDOW_S)
        t1 = time.time()
        packets = [h.packets() for h in net.hosts] if fault == "loss" else []
        after = current_round(client, keys)
        steps = {n: steps_between(tmp_path, n, t0, t1) for n in nodes}
        (tmp_path / "stop").touch()
        t_stop = time.monotonic()
        codes = exit_codes(nodes, 120)
        exit_s = time.monotonic() - t_stop
    assert before is not None and after is not None
    assert (after.round, sorted(after.members)) == (before.round, sorted(before.members)), (before, after)
    assert all(s > 10 for s in steps.values()), steps  # trained throughout, at world 3
    assert codes == {"h0": 0, "h1": 0, "h2": 0}, {n: p.output()[-8000:] for n, p in nodes.items()}
    if fault == "loss":
        sent, lost = sum(p[0] for p in packets), sum(p[1] for p in packets)
        assert lost > 0.02 * sent, packets  # the loss was real
        what = f"{lost} of {sent} packets dropped ({lost / sent:.1%})"
    else:
        assert proxy.connections >= 3  # every agent's etcd traffic went through the delay
        what = f"{proxy.connections} etcd connections delayed {DELAY_S * 1000:.0f} ms each way"
    print(
        f"\n{fault}: {what} for {WINDOW_S}s; round {before.round} kept; steps at world 3 meanwhile {steps}; "
        f"all agents exited {exit_s:.1f}s after the stop"
    )
