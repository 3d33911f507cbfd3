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
