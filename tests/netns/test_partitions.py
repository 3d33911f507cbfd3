"""Real network faults between hosts (Linux network namespaces on one machine, see hosts.py): three
`ermrun` hosts (the steps worker, or the example DLRM with its exactly-once checks: job.py), etcd on the
bridge with auto-compaction every 2 s (a small retention, as a busy cluster would reach), one host's link
down for four leases, then up again with its TCP connections reset (as a stateful firewall or NAT on the
path that forgot them would). Without the compacted-watch resync (elastic_rm/etcd/watch.py) the host
never rejoined: its view stayed at the round it was cut off in."""

from __future__ import annotations

import pytest

from tests.netns.hosts import why_unavailable
from tests.netns.job import SLOW, on_hosts

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

COMPACTION = ("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "2s")


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("role", "worker"),
    [
        ("leader", "steps"),
        pytest.param("member", "steps", marks=SLOW),
        pytest.param("member", "dlrm", marks=SLOW),
        pytest.param("leader", "dlrm", marks=SLOW),
    ],
)  # CI runs the leader's cut with the steps worker (the cut host is the leader: a new election, then the
# compacted-watch rejoin); the member's cut (~18 s) and the DLRM cases (exactly-once checks on real hosts,
# about 90 s each) run with `make test-all`, to keep the CI suite within its 20-minute budget on 2 cores
def test_a_host_cut_off_past_its_lease_while_etcd_compacts_rejoins(role, worker, run_id, tmp_path):
    """role: the host cut off is the run's leader node (its election key goes with its lease; another
    host leads) or another member."""
    with on_hosts(3, worker, tmp_path, run_id, COMPACTION) as (net, endpoint, client, job):
        before = job.start_all(client, net.hosts, [endpoint] * 3)
        leader = job.leader(client)
        cut = next(h for h in net.hosts if (h.name == leader) == (role == "leader"))
        rest = sorted(h.name for h in net.hosts if h is not cut)

        def heal() -> None:
            cut.link_up()
            cut.reset_connections()  # its connection state is gone: watches must start again from a revision

        o = job.outage(client, cut.link_down, heal, 2, 4 * job.lease_ttl)  # cut off for 4 leases
        new_leader = job.leader(client)
        final = job.finish(client)
        assert final["round"] > before.round + 1
        assert sorted(final["members"]) == sorted([*rest, f"{cut.name}-r1"]), final  # old id never returns
        assert (new_leader in rest) if role == "leader" else (new_leader == leader), (leader, new_leader)
        assert "is compacted" in job.output(cut.name)  # the scenario did reach the compacted-watch path
    checked = job.exactly_once({2, 3}, restarted=True)
    print(
        f"\n{role} {cut.name} cut off {4 * job.lease_ttl}s+ (lease {job.lease_ttl}s): "
        f"{rest} at world 2 {o.took:.1f}s after the cut; all at world 3 {o.back:.1f}s after the heal; "
        f"rounds {before.round} -> {final['round']}; "
        f"leader {leader} -> {new_leader}; {checked}"
    )
