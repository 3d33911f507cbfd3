"""Where the time from a member's SIGKILL to the survivors' first step goes (recovery part a, in place).

All offsets are seconds after the kill, read from what the run recorded: the leader's round record in
etcd (sealed when the lost member's lease expired), the survivors' agents' events (the drain skipped when
they saw that round; the in-place round's ``resume_s``, from their workers' failed collective to the
first step in the new round), and the example's progress rows (its ``start`` row comes after the
process group, the DMP build, the restore and a state digest)."""

from __future__ import annotations

from elastic_rm.demo.readers import rounds_from_etcd
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.events import read_etcd
from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace


def breakdown(endpoint: str, run_id: str, rows: list[dict], t_fault: float) -> dict:
    with EtcdClient(endpoint, timeout=5) as client:
        events, _errors, _ = read_etcd(client, Keyspace(DEFAULT_PREFIX, run_id))
    after = [e for e in events if e.time > t_fault]
    sealed = [r["t"] for r in rounds_from_etcd(endpoint, run_id) if r.get("t") and r["t"] > t_fault]
    seen = [e.time for e in after if e.kind == "drain" and e.data.get("skipped")]
    kept = [e for e in after if e.kind == "round" and e.data.get("after_loss")]
    fallback = [
        e.data.get("fallback") or e.message
        for e in after
        if e.kind == "round" and not e.data.get("in_place", True)
    ]
    starts = [r["t"] for r in rows if r.get("start") and r["t"] > t_fault]
    firsts = [r["t"] for r in rows if "step" in r and r["t"] > t_fault and r["world"] == 2]

    def off(values: list[float], pick=max) -> float | None:
        return round(pick(values) - t_fault, 3) if values else None

    return {
        # the workers' collectives failed and they said so (from the agents' resume_s)
        "collective_failed_s": off([e.time - e.data["resume_s"] for e in kept]),
        "round_sealed_s": off(sealed, min),  # the lease expiry, detected and sealed by the leader
        "agents_saw_round_s": off(seen),
        "restored_s": off(starts),  # + rendezvous, process group, DMP build, restore, state digest
        "first_step_s": off(firsts, min),
        "in_place": bool(kept) and not fallback,
        "fallback": fallback,
    }


# The worker's phases in its "start" row (examples/dlrm/train.py), in the order they happen.
WORKER_PHASES = (
    "body_ended",
    "collected",
    "stopped",
    "told_round",
    "imported",
    "built",
    "planned",
    "prepared",
    "group",
    "agreed",
    "wrapped",
    "restored",
    "checksum",
)


def planned(endpoint: str, run_id: str, rows: list[dict], last: float) -> dict:
    """Where a planned round's downtime goes, per node: seconds after rank 0's last step before the round
    (``last``), from the leader's round record, the agents' events (the drain requested and acknowledged,
    the round joined, the workers told or handed a spare) and the workers' progress rows (the drain hook's
    checkpoint; the new round's process group, model, sharding plan, DMP, restore, state digest and first
    step). ``critical``: the node whose first step came last (the downtime is its); ``left``: the drain
    phases of nodes not in the new round (a swapped straggler)."""
    with EtcdClient(endpoint, timeout=5) as client:
        events, _errors, _ = read_etcd(client, Keyspace(DEFAULT_PREFIX, run_id))
    window = [e for e in events if last - 30 < e.time]
    sealed = [r for r in rounds_from_etcd(endpoint, run_id) if r.get("t") and last - 30 < r["t"]]

    def off(t: float | None) -> float | None:
        return round(t - last, 3) if t is not None else None

    nodes: dict[str, dict] = {}
    for e in window:
        at = nodes.setdefault(e.node, {})
        if e.kind == "drain" and "elapsed_s" in e.data:
            at["drain_requested_s"] = off(e.time - e.data["elapsed_s"])
            at["drain_acked_s"] = off(e.time)
        elif e.kind == "round" and e.message.startswith("joined round"):
            at["joined_s"] = off(e.time)
        elif e.kind == "round" and e.data.get("in_place") and "told_at" in e.data:
            at.update(rendezvous_s=off(e.data["rendezvous_at"]), told_s=off(e.data["told_at"]))
        elif e.kind == "round" and "from_spares" in e.data:
            at["spare_handed_s"] = off(e.time)
    for r in rows:
        at = nodes.setdefault(r["node"], {})
        if "drained_step" in r and last - 1 <= r["t"] and isinstance(r.get("phases"), dict):
            at.update({f"drain_{k}_s": off(t) for k, t in r["phases"].items()})  # hook, save_*, saved
            at["drained_s"] = off(r["t"])
        elif r.get("start") and r["t"] > last and isinstance(r.get("phases"), dict):
            at.update({f"{k}_s": off(r["phases"][k]) for k in WORKER_PHASES if k in r["phases"]})
            at["in_place"] = bool(r.get("in_place"))
        elif "step" in r and r["t"] > last and "first_step_s" not in at and "checksum_s" in at:
            at["first_step_s"] = off(r["t"])
    left = {n: v for n, v in nodes.items() if "first_step_s" not in v and "drain_saved_s" in v}
    nodes = {n: v for n, v in nodes.items() if "first_step_s" in v}
    critical = max(nodes, key=lambda n: nodes[n]["first_step_s"]) if nodes else None
    return {
        "round_sealed_s": off(max(r["t"] for r in sealed)) if sealed else None,
        "nodes": nodes,
        "left": left,  # nodes that drained and are not in the new round (a swapped straggler)
        "critical": critical,
    }
