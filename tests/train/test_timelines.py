"""Timelines of checkpoints (elastic_rm/checkpoint/timeline.py): a restore that goes back to an older
step abandons the newer ones, and a node that no source of that restore reached must not bring them back
when it returns, neither as the newest step nor as a second, different copy of a step number the new
timeline saved again; and the vote on the current timeline reads every source the restore reads, the
nodes outside the round included (under ermrun every alive node that serves checkpoints is a source).
On real gloo worlds with TorchRec modules, differential saves and replicas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from erm_harness import assemble, assert_bit_exact, run_world

from elastic_rm.checkpoint.local_servers import NodeServer, node_servers, peer_lists
from tests.train.test_delta_fold import phase, spec, trained_saves

FLASH = {"differential": True, "replicate": True}


def on(nodes: list[str], p: dict[str, Any]) -> dict[str, Any]:
    return {**p, "nodes": nodes}


def everyone(servers: dict[str, NodeServer], members: list[str]) -> dict[str, Any]:
    """Each member's checkpoint peers as ermrun gives them: every other node that serves checkpoints."""
    return {n: {"v": 1, "peers": [s.peer() for m, s in servers.items() if m != n]} for n in members}


def timelines(node_dir: Path) -> dict[int, Any]:
    return {
        int(d.name.split("-")[1]): json.loads((d / "manifest.json").read_bytes()).get("timeline")
        for d in sorted(node_dir.glob("step-*"))
    }


def test_a_node_back_with_abandoned_steps_neither_hides_nor_revives_them(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    flash = {**FLASH, "memory_root": str(shm)}
    nodes = ["n0", "n1"]
    with node_servers(shm, ["n0", "n1", "n2", "n3"]) as s:
        both = everyone(s, nodes)
        # steps 1-5 on both nodes (each holds the other's replica)
        a = {**phase(2, trained_saves([1, 2, 3, 4, 5], dump=True), **flash), "peers": both}
        # n1 is out of reach; n0's own delta of step 4 is bad: n0 alone restores step 3, saves a new 4
        bad = {"do": "corrupt", "roots": [str(shm / "n0")], "step": 4, "file": "__0_delta.erm", "how": "flip"}
        b_actions = [
            bad,
            {"do": "restore"},
            {"do": "train", "seeds": [77]},
            {"do": "save", "step": 4, "block": True},
            {"do": "dump", "name": "new4"},
        ]
        b = {**on(["n0"], phase(1, b_actions, **flash)), "peers": peer_lists(s, ["n0"])}
        # n1 returns holding the old steps 4 and 5 (its own and n0's replica): the new step 4 is restored
        c_actions = [
            {"do": "restore"},
            {"do": "dump", "name": "c"},
            {"do": "train", "seeds": [78]},
            {"do": "save", "step": 5, "block": True},
            {"do": "dump", "name": "new5"},
        ]
        c = {**phase(2, c_actions, **flash), "peers": both}
        d = {**phase(2, [{"do": "restore"}, {"do": "dump", "name": "d"}], **flash), "peers": both}
        # two new nodes with empty memory; n0 and n1, outside the round, hold the current timeline
        e_actions = [{"do": "restore"}, {"do": "dump", "name": "e"}]
        e = {**on(["n2", "n3"], phase(2, e_actions, **flash)), "peers": everyone(s, ["n2", "n3"])}
        results = run_world(2, spec([a, b, c, d, e]), tmp_path)
    assert results[0][1]["restores"][0]["step"] == 3
    rc = results[0][2]["restores"][0]
    assert rc["step"] == 4, rc
    assert any("step 5" in why for why in rc["skipped"]), rc  # the old step 5 was passed over
    assert_bit_exact(assemble(tmp_path, "new4"), assemble(tmp_path, "c"), "the new timeline's step 4")
    rd = results[0][3]["restores"][0]
    assert rd["step"] == 5 and not rd["skipped"], rd
    assert_bit_exact(assemble(tmp_path, "new5"), assemble(tmp_path, "d"), "step 5 saved after the rejoin")
    re = results[0][4]["restores"][0]
    assert re["step"] == 5 and not re["skipped"], re
    assert_bit_exact(
        assemble(tmp_path, "new5"), assemble(tmp_path, "e"), "step 5 read from outside the round"
    )
    # the returned node's copies of the abandoned steps are gone; what is left is on one history
    for node_dir in (shm / "n1", shm / "n1" / "replicas" / "n0", shm / "n0", shm / "n0" / "replicas" / "n1"):
        held = timelines(node_dir)
        assert held[5] == {"id": 2, "from": [[0, 3], [1, 4]]}, (node_dir, held)
        assert all(
            t in ({"id": 0, "from": []}, {"id": 1, "from": [[0, 3]]}) for s, t in held.items() if s < 5
        )
        assert held.get(4) in (None, {"id": 1, "from": [[0, 3]]}), (node_dir, held)
