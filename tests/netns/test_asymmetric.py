"""Asymmetric partitions and ties between hosts (network namespaces, see hosts.py), the job on each host
the steps worker or the example DLRM with its exactly-once checks (job.py).
- A host that reaches its peers but not etcd (a blackhole route to etcd's address in its namespace): to
  the run a lease expiry; the others train at world 2, the host rejoins under a new id once its route is
  back.
- A host that reaches etcd but not its peers (blackhole routes to their addresses): its peer probe
  (elastic_rm/rendezvous/peer_probe.py) takes it out of the run, the others train at world 2, and it
  rejoins only once it reaches them again.
- A tie, where no majority decides: two hosts cut apart (each reaches etcd, neither the other), or three
  hosts with only the link between two of them cut. The node outranked by a peer it cannot reach (a later
  group rank) steps out after two probe windows, the others train on, and it rejoins after the heal."""

from __future__ import annotations

import pytest

from tests.netns.hosts import Host, why_unavailable
from tests.netns.job import SLOW, WORKERS, on_hosts

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

TIE = "(a tie: a peer it cannot reach ranks before it"


def routes(pairs: list[tuple[Host, Host]], on: bool) -> None:
    """Each (a, b): a stops reaching b (on) or reaches it again."""
    for a, b in pairs:
        (a.blackhole if on else a.unblackhole)(b.addr)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("worker", WORKERS)
# 19-30 s; CI keeps tests/netns/test_partitions.py's host cut off past its lease (its lease expires, it
# rejoins under a new id)
@pytest.mark.slow
def test_a_host_that_reaches_its_peers_but_not_etcd_is_a_lease_expiry_and_rejoins(worker, run_id, tmp_path):
    with on_hosts(3, worker, tmp_path, run_id) as (net, endpoint, client, job):
        before = job.start_all(client, net.hosts, [endpoint] * 3)
        leader = job.leader(client)
        cut = next(h for h in net.hosts if h.name != leader)
        rest = sorted(h.name for h in net.hosts if h is not cut)
        o = job.outage(
            client,
            lambda: cut.blackhole(net.gateway),
            lambda: cut.unblackhole(net.gateway),
            2,
            3 * job.lease_ttl,
        )
        final = job.finish(client)
        assert final["round"] > before.round + 1
        assert sorted(final["members"]) == sorted([*rest, f"{cut.name}-r1"]), final
    checked = job.exactly_once({2, 3}, restarted=True)
    print(
        f"\n{cut.name} without etcd: {rest} at world 2 {o.took:.1f}s after the cut; "
        f"all at world 3 {o.back:.1f}s after the heal; rounds {before.round} -> {final['round']}; {checked}"
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("worker", WORKERS)
# 21 s; CI keeps tests/rendezvous/test_peer_probe.py's step-out and rejoin (real handlers and etcd)
@pytest.mark.slow
def test_a_host_that_reaches_etcd_but_not_its_peers_steps_out_and_rejoins_after_the_heal(
    worker, run_id, tmp_path
):
    with on_hosts(3, worker, tmp_path, run_id) as (net, endpoint, client, job):
        before = job.start_all(client, net.hosts, [endpoint] * 3)
        leader = job.leader(client)
        cut = next(h for h in net.hosts if h.name != leader)
        pairs = [(cut, h) for h in net.hosts if h is not cut]
        rest = sorted(b.name for _, b in pairs)
        o = job.outage(
            client, lambda: routes(pairs, True), lambda: routes(pairs, False), 2, 3 * job.lease_ttl
        )
        final = job.finish(client)
        assert o.during is not None and sorted(o.during.members) == rest, o  # its gate held it back
        assert f"{cut.name}-r1" not in o.registered, o
        assert final["round"] > before.round + 1
        assert sorted(final["members"]) == sorted([*rest, f"{cut.name}-r1"]), final
        out = job.output(cut.name)
    left, rejoined = out.find("leaving the run"), out.find("again after")
    assert 0 <= left < rejoined, out[-3000:]  # it stepped out, then waited to reach its peers, then rejoined
    checked = job.exactly_once({2, 3}, restarted=True)
    print(
        f"\n{cut.name} without its peers: {rest} at world 2 {o.took:.1f}s after the cut; all at world 3 "
        f"{o.back:.1f}s after the heal; rounds {before.round} -> {final['round']}; {checked}"
    )


@pytest.mark.timeout(900)
# every case slow (22 s for 3 hosts on steps); CI keeps tests/rendezvous/test_peer_probe.py's tie rules
# (only the outranked node steps out, a tie holds longer than a majority, three failed probes) and its
# step-out and rejoin on real handlers and etcd
@pytest.mark.parametrize(
    ("hosts", "worker"),
    [
        pytest.param(3, "steps", marks=SLOW),
        pytest.param(2, "steps", marks=SLOW),
        pytest.param(3, "dlrm", marks=SLOW),
        pytest.param(2, "dlrm", marks=SLOW),
    ],
)
def test_a_tie_the_node_outranked_by_a_peer_it_cannot_reach_steps_out_and_rejoins(
    hosts, worker, run_id, tmp_path
):
    """hosts=2: two hosts cut apart (--nnodes 1:2; group rank 1 leaves, rank 0 trains on alone). hosts=3:
    the link between group ranks 0 and 1 cut, both and rank 2 still reaching etcd and each other: rank 1
    (outranked by rank 0, which it cannot reach) leaves, rank 2 (it reaches both) stays, and ranks 0 and
    2 train at world 2."""
    nnodes = f"{hosts - 1}:{hosts}"
    with on_hosts(hosts, worker, tmp_path, run_id, nnodes=nnodes) as (net, endpoint, client, job):
        before = job.start_all(client, net.hosts, [endpoint] * hosts)
        by_name = {h.name: h for h in net.hosts}
        stays, leaves = by_name[before.members[0]], by_name[before.members[1]]  # group ranks 0 and 1
        pairs = [(stays, leaves), (leaves, stays)]
        rest = sorted(n for n in before.members if n != leaves.name)
        o = job.outage(
            client,
            lambda: routes(pairs, True),
            lambda: routes(pairs, False),
            hosts - 1,
            4 * job.lease_ttl,
            hosts,
        )
        final = job.finish(client)
        assert o.during is not None and sorted(o.during.members) == rest, o  # not readmitted while cut off
        assert f"{leaves.name}-r1" not in o.registered, o
        assert sorted(final["members"]) == sorted([*rest, f"{leaves.name}-r1"]), final
        outs = {n: job.output(n) for n in before.members}
    # left by the tie-break after two probe windows (peer_probe: the lease TTL), waited, then rejoined
    windows = f"cannot reach 1 of {hosts - 1} peers ({stays.name}) for {2 * job.lease_ttl}s "
    windows += f"while etcd answers {TIE}"
    left, rejoined = outs[leaves.name].find(windows), outs[leaves.name].find("again after")
    assert 0 <= left < rejoined, outs[leaves.name][-3000:]
    assert all("leaving the run" not in outs[n] for n in rest), {n: outs[n][-3000:] for n in rest}
    checked = job.exactly_once({hosts - 1, hosts}, restarted=True)
    print(
        f"\na tie in a round of {hosts}: {leaves.name} (group rank 1) left, "
        f"{rest} trained at world {hosts - 1} {o.took:.1f}s after the cut; "
        f"all at world {hosts} {o.back:.1f}s after the heal; rounds {before.round} -> {final['round']}; "
        f"{checked}"
    )
