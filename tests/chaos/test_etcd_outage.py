"""etcd outages with real processes: the whole etcd stopped (SIGKILL by pid) and restarted on the same
port and data directory, and the raft leader of a 3-member cluster killed in the middle of a round.

What etcd does with leases across an outage (etcd-io/etcd#9395, #13294, and etcd's failure guide: "The
new leader extends timeouts automatically for all leases. This mechanism ensures no lease expires due to
server side unavailability."): only the leader counts lease time; a member that becomes leader (also a
single member after a restart) gives every lease its full TTL again. So an outage of any length does not
expire a node's lease by itself: nodes that stayed alive keep their keys, and a node that died during the
outage disappears one TTL after etcd is back. The tests assert exactly that.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.errors import EtcdError
from elastic_rm.etcd.lease import KeptLease
from elastic_rm.etcd.server import EtcdCluster, EtcdServer
from tests.chaos.helpers import (
    check_round_history,
    leader_index,
    node_keys,
    record_figures,
    round_history,
    round_record,
    round_records,
)
from tests.e2e.helpers import ermrun, records, steps_at_world, wait_until
from tests.ermrun_argv import node_args

OUTAGE_S = 30.0
CONF = "lease_ttl=5,last_call_timeout=0.5,join_timeout=120,etcd_timeout=3"


def steps_between(tmp_path, node: str, t0: float, t1: float) -> int:
    return sum(1 for r in records(tmp_path, node) if "step" in r and t0 <= r["t"] <= t1)


def _answers(c: EtcdClient) -> bool:
    try:
        c.ping()
        return True
    except EtcdError:
        return False


def test_leases_survive_an_outage_longer_than_their_ttl_and_expire_one_ttl_after(tmp_path):
    """The etcd fact the rest relies on, at the facade: a lease with TTL 2 s, etcd down for 5 s, is
    alive after the restart with its TTL renewed; a lease nobody refreshes then expires; a kept lease
    is never reported lost; a watch resumes and misses nothing."""
    data = str(tmp_path / "etcd-data")
    with EtcdServer(data_dir=data) as server, EtcdClient(server.endpoint, timeout=2) as c:
        kept = KeptLease(c, 2)
        idle_id, idle_ttl = c.lease_grant(2)
        c.put("/chaos/kept", "k", lease=kept.id)
        c.put("/chaos/idle", "i", lease=idle_id)
        seen: list[str] = []
        cancel = c.watch_prefix("/chaos/w/", c.ping() + 1, lambda evs: seen.extend(e.kv.key for e in evs))
        c.put("/chaos/w/before", "1")
        port, pid = server.members[0].client_port, server.members[0].proc.pid  # type: ignore[union-attr]
        server.kill(0)  # SIGKILL by pid
        down = time.monotonic()
        time.sleep(5.0)  # 2.5 x the TTL
        server.restart(0)
        back = time.monotonic()
        assert server.members[0].client_port == port and server.members[0].proc.pid != pid
        wait_until(lambda: _answers(c), 20, "the client to reconnect (gRPC reconnect backoff <= 1 s)")
        assert c.get("/chaos/kept") is not None and c.get("/chaos/idle") is not None  # nothing expired
        after_restart = c.lease_refresh(idle_id)  # refreshing the idle lease once: it lives on
        assert after_restart > 0
        c.put("/chaos/w/after", "2")
        expired_in = None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:  # now nobody refreshes it: it must go
            if c.get("/chaos/idle") is None:
                expired_in = time.monotonic() - t0
                break
            time.sleep(0.1)
        assert expired_in is not None, "an unrefreshed lease never expired after the outage"
        assert not kept.lost and c.get("/chaos/kept") is not None
        wait_until(lambda: "/chaos/w/after" in seen, 20, "the watch to resume after the restart")
        assert seen == ["/chaos/w/before", "/chaos/w/after"]  # nothing missed, nothing repeated
        cancel()
        kept.revoke()
        record_figures(
            tmp_path,
            "lease_across_outage",
            {"ttl_s": idle_ttl, "down_s": back - down, "idle_lease_expired_s_after_last_refresh": expired_in},
        )


def start_job(
    tmp_path,
    endpoint: str,
    run_id: str,
    names: list[str],
    nnodes: str,
    procs,
    conf: str = CONF,
    extra: tuple[str, ...] = (),
):
    nodes = {n: ermrun(tmp_path, n, [*extra, *node_args(endpoint, run_id, nnodes, n, conf)]) for n in names}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, len(names)) > 5 for n in nodes),
        180,
        f"{len(names)} nodes training",
        nodes.values(),
    )
    return nodes


@pytest.mark.slow
def test_whole_etcd_down_30s_training_goes_on_and_no_round_follows(run_id, tmp_path, procs):
    data = str(tmp_path / "etcd-data")
    with EtcdServer(data_dir=data) as server:
        nodes = start_job(tmp_path, server.endpoint, run_id, ["a", "b"], "2", procs)
        with EtcdClient(server.endpoint) as c:
            before_round = round_record(c, run_id)
            before_nodes = node_keys(c, run_id)
            leader_before = c.get(f"/elastic-rm/{run_id}/leader")
        server.kill(0)
        down = time.time()
        time.sleep(OUTAGE_S)
        during = {n: steps_between(tmp_path, n, down + 1, time.time()) for n in nodes}
        server.restart(0)
        up = time.time()
        # three lease TTLs after etcd returned: long enough for any spurious expiry or round to show
        wait_until(
            lambda: all(steps_between(tmp_path, n, up, time.time()) > 20 for n in nodes),
            120,
            "training after etcd returned",
            nodes.values(),
        )
        time.sleep(15)
        with EtcdClient(server.endpoint) as c:
            after_round = round_record(c, run_id)
            after_nodes = node_keys(c, run_id)
            leader_after = c.get(f"/elastic-rm/{run_id}/leader")
            history = round_history(c, run_id)
        # workers trained all through the outage (no etcd call inside a step)
        assert all(during[n] > 20 for n in nodes), during
        # agents reconnected without a spurious round: same round, same record, same world
        assert after_round == before_round, (before_round, after_round)
        assert [r for r, _, _ in history] == [before_round["round"]] * len(history)
        # leases: the same leases hold the same node keys (renewed by etcd on restart, kept alive by the
        # agents), and the same node still leads
        assert {n: (v["_lease"], v["_create"]) for n, v in after_nodes.items()} == {
            n: (v["_lease"], v["_create"]) for n, v in before_nodes.items()
        }
        assert leader_after.create_revision == leader_before.create_revision
        assert all(p.popen.poll() is None for p in nodes.values()), "an agent exited"
        record_figures(
            tmp_path,
            "etcd_down_30s",
            {"outage_s": up - down, "steps_during_outage": during, "round": after_round["round"]},
        )


@pytest.mark.slow
def test_etcd_down_past_the_lease_with_a_node_lost_meanwhile_gives_one_clean_round(run_id, tmp_path, procs):
    """etcd down for 30 s (6 lease TTLs) and node c SIGKILLed while it is down: nobody can notice until
    etcd is back; then c's lease (renewed to a full TTL by the restart) expires and exactly one new round
    of the survivors follows. Nothing else is lost: earlier rounds' records, the survivors' keys.

    The survivors' workers fail at once (their peer is gone) and no new round can be written while etcd
    is down, so the agents must wait longer than the default membership grace (lease TTL + 1 s) for it:
    --membership-grace 60 here. With the default the failure counts against --max-restarts (at 0 the
    job ends); docs/guarantees.md says so."""
    data = str(tmp_path / "etcd-data")
    with EtcdServer(data_dir=data) as server:
        nodes = start_job(
            tmp_path,
            server.endpoint,
            run_id,
            ["a", "b", "c"],
            "2:3",
            procs,
            extra=("--membership-grace", "60"),
        )
        with EtcdClient(server.endpoint) as c:
            before_round = round_record(c, run_id)
            before_records = round_records(c, run_id)
            before_nodes = node_keys(c, run_id)
        server.kill(0)
        down = time.time()
        time.sleep(2)
        nodes["c"].signal(signal.SIGKILL)
        time.sleep(OUTAGE_S - 2)
        server.restart(0)
        up = time.time()
        wait_until(
            lambda: all(
                steps_between(tmp_path, n, up, time.time()) > 0 and steps_at_world(tmp_path, n, 2, up) > 10
                for n in ("a", "b")
            ),
            120,
            "survivors training at world 2",
            nodes.values(),
        )
        time.sleep(10)  # two more TTLs: a second (spurious) round would show now
        with EtcdClient(server.endpoint) as c:
            after_round = round_record(c, run_id)
            after_records = round_records(c, run_id)
            after_nodes = node_keys(c, run_id)
            history = round_history(c, run_id)
        check_round_history(history)
        assert after_round["round"] == before_round["round"] + 1, (before_round, after_round)
        assert after_round["sealed"] and sorted(after_round["members"]) == ["a", "b"]
        for n, rec in before_records.items():  # no lost state: old records untouched
            assert {k: v for k, v in after_records[n].items() if k != "_version"} == {
                k: v for k, v in rec.items() if k != "_version"
            }
        assert sorted(after_nodes) == ["a", "b"]
        for n in ("a", "b"):
            assert after_nodes[n]["_lease"] == before_nodes[n]["_lease"]  # the survivors' leases lived on
            assert after_nodes[n]["round"] == after_round["round"]  # members agree on the round
        survivors_world2 = [
            r for n in ("a", "b") for r in records(tmp_path, n) if r.get("start") and r["t"] > up
        ]
        assert len(survivors_world2) == 2 and {r["world"] for r in survivors_world2} == {
            2
        }  # one restart each
        record_figures(
            tmp_path,
            "etcd_down_past_lease_node_lost",
            {
                "outage_s": up - down,
                "rounds": [h[:2] for h in history],
                "new_round_after_etcd_back_s": min(r["t"] for r in survivors_world2) - up,
            },
        )


@pytest.mark.slow
def test_etcd_leader_member_killed_during_a_rounds_ack_phase_loses_and_doubles_nothing(
    run_id, tmp_path, procs
):
    with EtcdCluster(size=3) as cluster:
        endpoints = ",".join(cluster.endpoints)
        conf = "lease_ttl=3,last_call_timeout=0.5,join_timeout=120,etcd_timeout=3"
        nodes = start_job(tmp_path, endpoints, run_id, ["a", "b"], "2:3", procs, conf=conf)
        victim = leader_index(cluster)
        survivors = ",".join(ep for i, ep in enumerate(cluster.endpoints) if i != victim)
        killed = threading.Event()
        kill_info: dict = {}

        def on_round(events) -> None:
            for e in events:
                r = json.loads(e.kv.value)
                if e.kind == "put" and not r.get("sealed") and r["round"] >= 2 and not killed.is_set():
                    proc = cluster.members[victim].proc
                    assert proc is not None
                    proc.send_signal(signal.SIGKILL)  # at once, from the watch callback: mid ack phase
                    killed.set()
                    kill_info.update(round=r["round"], revision=e.kv.mod_revision, t=time.time())

        with EtcdClient(survivors) as watcher:
            cancel = watcher.watch_prefix(
                f"/elastic-rm/{run_id}/round", watcher.ping() + 1, on_round, exact=True
            )
            c_node = ermrun(tmp_path, "c", node_args(endpoints, run_id, "2:3", "c", conf))  # scale-up round
            procs.append(c_node)
            nodes["c"] = c_node
            wait_until(killed.is_set, 120, "an unsealed round to kill the etcd leader in", nodes.values())
            cluster.members[victim].proc.wait(10)  # type: ignore[union-attr]
            wait_until(
                lambda: all(steps_at_world(tmp_path, n, 3, kill_info["t"]) > 5 for n in nodes),
                180,
                "world 3 through the surviving etcd members",
                nodes.values(),
            )
            cancel()
            time.sleep(5)
            history = round_history(watcher, run_id)
            final = round_record(watcher, run_id)
            recs = round_records(watcher, run_id)
            keys = node_keys(watcher, run_id)
        check_round_history(history)
        assert sorted(recs) == list(range(1, final["round"] + 1))  # every round's record, once each
        assert all(r["_version"] <= 2 for r in recs.values()), recs  # unsealed + sealed at most
        assert final["sealed"] and sorted(final["members"]) == ["a", "b", "c"]
        assert all(keys[n]["round"] == final["round"] for n in ("a", "b", "c")), keys  # members agree
        sealed_after_kill = any(
            r == kill_info["round"] and c and rev > kill_info["revision"] for r, c, rev in history
        )
        record_figures(
            tmp_path,
            "etcd_leader_killed_mid_round",
            {
                "killed_member": victim,
                "killed_in_round": kill_info["round"],
                "rounds": [h[:2] for h in history],
                "that_round_sealed_after_the_kill": sealed_after_kill,
            },
        )
