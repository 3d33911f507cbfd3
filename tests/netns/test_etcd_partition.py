"""The etcd member holding the raft leadership partitioned from a 3-member cluster, each member a host of
its own (etcd_hosts.py), three `ermrun` hosts (the steps worker, or the example DLRM with its
exactly-once checks: job.py) on the same bridge. Each job host lists the members in a different order,
so one agent's connection is to the member that is cut off (it must fail over) and two are to followers
(they see only the election)."""

from __future__ import annotations

import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from tests.netns.etcd_hosts import NetnsEtcd
from tests.netns.hosts import Network, why_unavailable
from tests.netns.job import WORKERS, Job, current_round

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

LEASE_TTL = 3
ETCD_TIMEOUT = 1


@pytest.mark.timeout(900)
@pytest.mark.parametrize("worker", WORKERS)
def test_the_raft_leader_member_partitioned_from_a_3_member_cluster(worker, run_id, tmp_path):
    with (
        Network(6) as net,
        NetnsEtcd(net.hosts[:3], str(tmp_path)) as etcd,
        EtcdClient(etcd.endpoint, timeout=5) as client,
        Job(worker, tmp_path, run_id, conf=f",etcd_timeout={ETCD_TIMEOUT}", lease_ttl=LEASE_TTL) as job,
    ):
        jobs, eps = net.hosts[3:], etcd.endpoints
        before = job.start_all(client, jobs, [",".join(eps[k:] + eps[:k]) for k in range(3)])
        lead = etcd.wait_leader(10)
        on_cut = jobs[lead].name  # the job host whose first endpoint is the cut member
        etcd.hosts[lead].link_down()
        t_cut = time.time()
        rest = [i for i in range(3) if i != lead]
        new_lead = etcd.wait_leader(10, among=rest)
        elected = time.time() - t_cut
        took = job.wait_world(
            3, t_cut + LEASE_TTL + 2, "all three hosts training at world 3 after the cut", 60
        )
        with EtcdClient([eps[i] for i in rest], timeout=5) as others:
            during = current_round(others, job.keys)
        etcd.hosts[lead].link_up()
        t_heal = time.time()
        etcd.wait_leader(30)  # the cut member follows again: all three agree
        rejoined = time.time() - t_heal
        job.wait_world(3, time.time(), "training after the heal", 60, steps=1)
        final = job.finish(client)
        failed_over = "switching to endpoint" in job.output(on_cut)
    assert new_lead != lead
    assert during is not None
    # every host is in the final round; one whose lease ran out in the election rejoined under a new id
    assert sorted(m.split("-r")[0] for m in final["members"]) == sorted(before.members), (
        before,
        during,
        final,
    )
    lost = sorted(set(final["members"]) - set(before.members))
    assert failed_over  # the agent on the cut member did fail over to a follower
    checked = job.exactly_once({3}, restarted=False)
    print(
        f"\nraft leader member {lead} cut off: new leader {new_lead} in {elected:.1f}s; "
        f"all 3 hosts at world 3 {took:.1f}s after the cut (lease {LEASE_TTL}s); "
        f"rounds {before.round} -> {during.round} -> {final['round']}; "
        f"the member followed again {rejoined:.1f}s after the heal; {on_cut} used that member; "
        f"leases lost: {lost or 'none'}; {checked}"
    )
