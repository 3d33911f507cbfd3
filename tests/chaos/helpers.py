"""Shared by the chaos tests: ermrun nodes against an etcd the test owns, and what etcd says of the run."""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.request
from dataclasses import dataclass, field

from elastic_rm.etcd.client import EtcdClient, WatchEvent
from elastic_rm.etcd.server import EtcdCluster

FIGURES_ENV = "ERM_CHAOS_FIGURES"  # a directory: each chaos test leaves its measurements there as JSON


def record_figures(tmp_path, name: str, figures: dict) -> None:
    """Measurements are recorded, never asserted: into the test's directory and $ERM_CHAOS_FIGURES."""
    text = json.dumps(figures, indent=1, sort_keys=True, default=str)
    (tmp_path / f"{name}.figures.json").write_text(text)
    out = os.environ.get(FIGURES_ENV)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, f"{name}.json"), "w") as fh:
            fh.write(text)
    print(f"[chaos] {name}: {text}")


def round_record(client: EtcdClient, run_id: str) -> dict | None:
    kv = client.get(f"/elastic-rm/{run_id}/round")
    return None if kv is None else {**json.loads(kv.value), "_mod": kv.mod_revision}


def round_records(client: EtcdClient, run_id: str) -> dict[int, dict]:
    """rounds/<n>/record of every round, with the key's version (1: written once; 2: unsealed + sealed)."""
    kvs, _ = client.get_prefix(f"/elastic-rm/{run_id}/rounds/")
    out = {}
    for kv in kvs:
        if kv.key.endswith("/record"):
            rec = json.loads(kv.value)
            out[rec["round"]] = {**rec, "_version": kv.version}
    return out


def round_history(client: EtcdClient, run_id: str, settle_s: float = 1.5) -> list[tuple[int, bool, int]]:
    """Every write of the round key since the run began: (round, complete, revision), in revision order
    (a watch from the key's creation: the session's etcd is shared, and a test that compacted it earlier
    would otherwise make a watch from revision 1 resync to the current value alone)."""
    got: list[WatchEvent] = []
    lock = threading.Lock()

    def on_events(events: list[WatchEvent]) -> None:
        with lock:
            got.extend(events)

    key = f"/elastic-rm/{run_id}/round"
    first = client.get(key)
    cancel = client.watch_prefix(key, first.create_revision if first else 1, on_events, exact=True)
    try:
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until no new event arrived for settle_s
            with lock:
                n = len(got)
            if n != last:
                last, stable_since = n, time.monotonic()
            elif time.monotonic() - stable_since > settle_s:
                break
            time.sleep(0.1)
    finally:
        cancel()
    with lock:
        events = [e for e in got if e.kind == "put"]
    return [
        (json.loads(e.kv.value)["round"], bool(json.loads(e.kv.value).get("sealed")), e.kv.mod_revision)
        for e in events
    ]


def check_round_history(history: list[tuple[int, bool, int]]) -> None:
    """No round lost or doubled: numbers go up by exactly one; each round is written at most once
    unsealed and at most once sealed, the sealed write last. A round may be superseded unsealed (a
    member died before acking it): it never ran, and the next number replaces it."""
    assert history, "no round was ever written"
    numbers = [r for r, _, _ in history]
    assert numbers == sorted(numbers), f"round numbers went backwards: {history}"
    distinct = sorted(set(numbers))
    assert distinct == list(range(distinct[0], distinct[-1] + 1)), f"a round number was skipped: {distinct}"
    assert distinct[0] == 1, history
    for n in distinct:
        writes = [c for r, c, _ in history if r == n]
        assert writes in ([True], [False, True], [False]), f"round {n} written as {writes}: {history}"
    assert history[-1][1], f"the last round was never sealed: {history}"


def node_keys(client: EtcdClient, run_id: str) -> dict[str, dict]:
    kvs, _ = client.get_prefix(f"/elastic-rm/{run_id}/nodes/")
    return {
        kv.key.rsplit("/", 1)[-1]: {**json.loads(kv.value), "_lease": kv.lease, "_create": kv.create_revision}
        for kv in kvs
    }


@dataclass
class Member:
    """One etcd member as the maintenance API reports it."""

    endpoint: str
    member_id: int
    leader: int
    raft_term: int = 0
    extra: dict = field(default_factory=dict)


def member_status(endpoint: str) -> Member | None:
    """etcd's Maintenance.Status over its HTTP gateway: which member this is and whom it follows."""
    req = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=2) as r:
            d = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return Member(endpoint, int(d["header"]["member_id"]), int(d.get("leader", 0)), int(d.get("raftTerm", 0)))


def leader_index(cluster: EtcdCluster) -> int:
    """Index in cluster.members of the raft leader (by asking every live member)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        found = [
            (i, member_status(ep)) for i, ep in enumerate(cluster.endpoints) if cluster.members[i].alive()
        ]
        for i, m in found:
            if m is not None and m.member_id == m.leader and m.leader != 0:
                return i
        time.sleep(0.1)
    raise AssertionError("no etcd member reports itself leader within 20 s")
