"""Two restores in a row in one process (rounds in place: a member is lost again before the first save
after a restore). The first restore passed over a bad newer step and started a new timeline; the
second finds no manifest of that timeline yet (nothing was saved on it), and must still keep it: the
saves after it must not go on the abandoned timeline, where a node out of reach at the first restore
still holds the old steps of the same numbers (docs/train.md, "Timelines"). On a real gloo world with
TorchRec modules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from erm_harness import run_world

from tests.train.test_delta_fold import phase, spec, trained_saves


@pytest.mark.slow  # 8 s; CI keeps test_timelines.py's abandoned-steps case (the vote at a restore)
def test_a_second_restore_keeps_the_timeline_the_first_one_started(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    flash = {"memory_root": str(shm), "keep_memory": 3}
    a = phase(1, trained_saves([1, 2, 3]), **flash)
    bad = {"do": "corrupt", "roots": [str(shm / "n0")], "step": 3, "file": "__0_0.distcp", "how": "flip"}
    actions = [
        bad,
        {"do": "restore"},  # step 3 is refused: step 2 is restored, and timeline 1 starts
        {"do": "restore"},  # again, before any save (a member lost again)
        {"do": "train", "seeds": [33]},
        {"do": "save", "step": 3, "block": True},
    ]
    b = phase(1, actions, **flash)
    results = run_world(1, spec([a, b]), tmp_path)
    first, second = results[0][1]["restores"]
    assert first["step"] == 2 and first["skipped"], first
    assert second["step"] == 2, second
    saved = json.loads((shm / "n0" / "step-00000003" / "manifest.json").read_bytes())
    # off timeline 0 after step 2 (the second restore may start another id: a fork of no save can still
    # have had saves where this node did not see them, so its id is not taken again)
    assert saved["timeline"]["id"] > 0 and saved["timeline"]["from"] == [[0, 2]], saved["timeline"]
