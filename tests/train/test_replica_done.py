"""A step counts as replicated everywhere only once every node's push of it went through: each
leader's push result is gathered at the end of the save, and wait() reports the pushes that failed."""

from __future__ import annotations

from pathlib import Path

from erm_harness import run_world
from test_delta_ckpt import phase, spec

from elastic_rm.checkpoint.local_servers import node_servers, peer_lists


def test_a_failed_replica_push_is_reported_and_the_step_is_not_replicated_everywhere(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    nodes = ["n0", "n1"]
    with node_servers(shm, nodes) as s:
        actions = [
            {"do": "init"},
            {"do": "train", "seeds": [1]},
            {"do": "save", "step": 1},
            {"do": "wait"},
            {"do": "kill", "pid": s["n1"].proc.pid},  # n0's ring peer: n0's next push fails
            {"do": "train", "seeds": [2]},
            {"do": "save", "step": 2},
            {"do": "wait"},
        ]
        flash = {"memory_root": str(shm), "replicate": True, "differential": False}
        phases = [{**phase(2, tmp_path, actions, **flash), "peers": peer_lists(s, nodes)}]
        results = run_world(2, spec(phases), tmp_path)
    for rank in range(2):
        first, second = results[rank][0]["waits"]
        assert first == {"failed": [], "replicated_everywhere": 1}
        assert second["replicated_everywhere"] == 1, "a step whose push failed counted as replicated"
        assert len(second["failed"]) == 1 and second["failed"][0].startswith("n0 -> n1: step 2: ")
    assert (shm / "n1" / "replicas" / "n0" / "step-00000001").is_dir()
    assert not (shm / "n1" / "replicas" / "n0" / "step-00000002").exists()
