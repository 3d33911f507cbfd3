"""A recorded run for report and status tests: 3 decisions, a lost node, samples from 3 nodes (one with a
GPU), as the agents and the leader write them: round records in etcd, events in etcd and in a file."""

from __future__ import annotations

import json

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.events import Event
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord

T0 = 1_764_500_000.0
ROUNDS = (  # round, start (s), members, reason, predicted gain
    (1, 0.0, ("n0", "n1"), "first round of 2 node(s)", None),
    (2, 40.0, ("n0", "n1", "n2"), "scale up: predicted gain above 20%", 0.4),
    (3, 80.0, ("n0", "n1"), "node n2 lost", None),
)
RESTORES = (  # round, time (s), restored step, newest step before, downtime per node, reporting nodes
    (2, 43.0, 400, 400, {"n0": 2.1, "n1": 2.4}, ("n0", "n1", "n2")),  # a drain: nothing trained again
    (3, 84.0, 780, 787, {"n0": 4.7, "n1": 4.9}, ("n0", "n1")),  # n2 lost: 7 steps trained again
)
RATE = {1: 1000.0, 2: 1300.0, 3: 950.0}  # samples/s of each node's workers, summed per round below


def outcome(number: int) -> dict:
    """The leader's outcome record of a round after the first (as rendezvous/leader.py writes it)."""
    before, after = RATE[number - 1], RATE[number]
    predicted = next(g for n, _, _, _, g in ROUNDS if n == number)
    measured = after / before - 1
    return {
        "v": 1,
        "round": number,
        "reason": "r",
        "world": 2,
        "throughput_before": before,
        "throughput_after": after,
        "measured_gain": measured,
        "predicted_gain": predicted,
        "prediction_error": None if predicted is None else predicted - measured,
        "time": T0 + 30.0 + 40.0 * (number - 1),
    }


def events(run_id: str) -> list[Event]:
    out = []
    for number, start, members, reason, gain in ROUNDS:
        data = {
            "round": number,
            "members": list(members),
            "standby": [],
            "reason": reason,
            "predicted_gain": gain,
            "confidence": None if gain is None else 0.8,
            "sealed": False,
        }
        out.append(Event(T0 + start, run_id, "n0", "decision", f"round {number}: {reason}", data))
        end = next((s for n, s, *_ in ROUNDS if n == number + 1), 120.0)
        for node in members:
            for i, t in enumerate(range(int(start) + 2, int(end), 5)):
                rate = RATE[number] / len(members) * (0.5 if i == 0 else 1.0)  # the first sample ramps up
                data = {
                    "round": number,
                    "world": len(members),
                    "rank": members.index(node),
                    "cpu": 0.3 + 0.1 * members.index(node),
                    "mem_used_bytes": (4 + i % 3) * 2**30,
                    "mem_total_bytes": 16 * 2**30,
                    "gpu_util": [0.7] if node == "n0" else [],
                    "samples_per_s": rate,
                    "step_p50_s": 0.01,
                }
                out.append(Event(T0 + t + 0.1 * members.index(node), run_id, node, "sample", "s", data))
    for node, (number, t, step, last, down, _) in [(n, r) for r in RESTORES for n in r[5]]:
        data = {
            "round": number,
            "step": step,
            "world_before": 2 if number == 2 else 3,
            "world_after": 3 if number == 2 else 2,
            "last_step_before": last if node in down else None,
            "redone_steps": last - step if node in down else None,
            "downtime_s": down.get(node),
            "sources": {},
            "files_by_source": {},
        }
        out.append(Event(T0 + t, run_id, node, "restore", f"round {number}: restored step {step}", data))
    for number in (2, 3):
        o = outcome(number)
        out.append(
            Event(
                o["time"],
                run_id,
                "n0",
                "outcome",
                f"round {number}",
                {k: v for k, v in o.items() if k != "v"},
            )
        )
    out.append(
        Event(
            T0 + 77.0,
            run_id,
            "n2",
            "failure",
            "worker group failed: rank(s) [2] exit code(s) [-9]",
            {"ranks": [2], "exit_codes": [-9]},
        )
    )
    return sorted(out, key=lambda e: e.time)


def write(client: EtcdClient, keys: Keyspace, file_path: str) -> list[Event]:
    """Round records, every other event and every restore event in etcd; every event in the file (so they
    overlap)."""
    evs = events(keys.run_id)
    for number, start, members, reason, gain in ROUNDS:
        record = RoundRecord(
            number,
            members,
            reason=reason,
            leader="n0",
            sealed=True,
            predicted_gain=gain,
            confidence=None if gain is None else 0.8,
            time=T0 + start,
        )
        client.put(keys.record(number), record.to_json())
        if number > 1:
            client.put(keys.outcome(number), json.dumps(outcome(number)))
    for i, e in enumerate(evs):
        if i % 2 == 0 or e.kind == "restore":  # restores all in etcd too: erm status reads etcd alone
            client.put(f"{keys.events}{int(e.time * 1e9):020d}-{e.node}-{i:06d}", e.to_json())
    with open(file_path, "w") as f:
        f.writelines(e.to_json() + "\n" for e in evs)
    return evs
