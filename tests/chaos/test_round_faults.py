"""A node SIGKILLed in the middle of a round. The job must converge to one consistent round of the
survivors (round numbers consecutive, no round sealed without all its members' acks, every member agreeing
on the final round) and train in it.

Two moments, each timed by watching etcd: (1) the leader wrote round n (unsealed) and the victim has not
acked it yet: the round can never be sealed, the victim's lease expires, round n+1 replaces it; (2) the
victim acked and the leader sealed round n: the survivors are already in torch's rank exchange for round n
(the agents' store), waiting for the victim's entry.
"""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from tests.chaos.helpers import check_round_history, node_keys, record_figures, round_history
from tests.chaos.helpers import round_record as read_round
from tests.e2e.helpers import ermrun, steps_at_world, wait_until
from tests.ermrun_argv import node_args

CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"


def _kill_during_a_round(etcd, run_id, tmp_path, procs, moment: str, conf: str = CONF) -> None:
    names = ["a", "b", "c"]
    nodes = {n: ermrun(tmp_path, n, node_args(etcd.endpoint, run_id, "2:4", n, conf)) for n in names}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 3) > 5 for n in names),
        180,
        "3 nodes training",
        nodes.values(),
    )
    with EtcdClient(etcd.endpoint) as c:
        leader = c.get(f"/elastic-rm/{run_id}/leader").value.decode()
        # after_seal: the joiner d, which acks at once (it runs no workers); it is stopped at its ack, so
        # that it cannot take part in anything after the seal, and killed when the seal appears
        victim = "d" if moment == "after_seal" else next(n for n in names if n != leader)
        current = read_round(c, run_id)["round"]
        killed = threading.Event()
        info: dict = {}
        acks: set[str] = set()

        def on_events(events) -> None:
            for e in events:
                if e.kind != "put" or killed.is_set():
                    continue
                if "/acks/" in e.kv.key:
                    acks.add(e.kv.key)
                    if moment == "after_seal" and e.kv.key.endswith(f"/acks/{victim}") and victim in nodes:
                        nodes[victim].signal(signal.SIGSTOP)
                if e.kv.key != f"/elastic-rm/{run_id}/round":
                    continue
                r = json.loads(e.kv.value)
                ack_key = f"/elastic-rm/{run_id}/rounds/{r['round']:08d}/acks/{victim}"
                if r["round"] <= current or victim not in r["members"]:
                    continue
                if (moment == "before_ack" and not r.get("sealed") and ack_key not in acks) or (
                    moment == "after_seal" and r.get("sealed")
                ):
                    nodes[victim].signal(signal.SIGKILL)
                    nodes[victim].signal(signal.SIGCONT)
                    killed.set()
                    info.update(round=r["round"], revision=e.kv.mod_revision, t=time.time())

        cancel = c.watch_prefix(f"/elastic-rm/{run_id}/", c.ping() + 1, on_events)
        d = ermrun(tmp_path, "d", node_args(etcd.endpoint, run_id, "2:4", "d", conf))  # asks for round n+1
        procs.append(d)
        nodes["d"] = d
        wait_until(killed.is_set, 120, f"round n+1 at the moment {moment}", nodes.values())
        survivors = [n for n in [*names, "d"] if n != victim]
        want = len(survivors)
        wait_until(
            lambda: all(steps_at_world(tmp_path, n, want, info["t"]) > 5 for n in survivors),
            180,
            f"the survivors training at world {want}",
            nodes.values(),
        )
        cancel()
        time.sleep(4)  # two lease TTLs: a late extra round would show
        final = read_round(c, run_id)
        history = round_history(c, run_id)
        keys = node_keys(c, run_id)
    check_round_history(history)
    assert final["sealed"] and sorted(final["members"]) == sorted(survivors), final
    assert final["round"] > info["round"]  # the victim was in that round: a later one replaced it
    assert victim not in keys and all(keys[n]["round"] == final["round"] for n in survivors), keys
    assert all(p.popen.poll() is None for n, p in nodes.items() if n != victim), "a surviving agent exited"
    record_figures(
        tmp_path,
        f"node_killed_{moment}",
        {
            "victim": victim,
            "killed_in_round": info["round"],
            "final_round": final["round"],
            "rounds": [h[:2] for h in history],
        },
    )


@pytest.mark.slow
def test_member_killed_before_acking_a_new_round_converges_to_one_round(etcd, run_id, tmp_path, procs):
    _kill_during_a_round(etcd, run_id, tmp_path, procs, "before_ack")


@pytest.mark.slow
def test_member_killed_right_after_the_seal_converges_to_one_round(etcd, run_id, tmp_path, procs):
    _kill_during_a_round(
        etcd, run_id, tmp_path, procs, "after_seal", "lease_ttl=5,last_call_timeout=0.5,join_timeout=60"
    )


@pytest.mark.slow
def test_node_restarted_under_the_same_id_within_its_lease_rejoins(etcd, run_id, tmp_path, procs):
    """A supervisor restarts a SIGKILLed ermrun at once with the same --node-id (stable ids keep a node's
    flash checkpoint): the old process's lease still lives. The job must get back to world 2 with it."""
    conf = "lease_ttl=5,last_call_timeout=0.5,join_timeout=60"
    nodes = {n: ermrun(tmp_path, n, node_args(etcd.endpoint, run_id, "2", n, conf)) for n in ("a", "b")}
    procs.extend(nodes.values())
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 2) > 5 for n in nodes),
        180,
        "2 nodes training",
        nodes.values(),
    )
    nodes["b"].signal(signal.SIGKILL)
    nodes["b"].stop()
    t = time.time()
    nodes["b"] = ermrun(tmp_path, "b", node_args(etcd.endpoint, run_id, "2", "b", conf))
    procs.append(nodes["b"])
    wait_until(
        lambda: all(steps_at_world(tmp_path, n, 2, since=t) > 5 for n in nodes),
        180,
        "both nodes training again",
        nodes.values(),
    )
    with EtcdClient(etcd.endpoint) as c:
        history = round_history(c, run_id)
    check_round_history(history)
    assert all(p.popen.poll() is None for p in nodes.values())
    record_figures(
        tmp_path, "node_restarted_same_id", {"rounds": [h[:2] for h in history], "back_s": time.time() - t}
    )
