"""A replica delta is committed only when its whole chain is held here (elastic_rm.checkpoint.store):
its parent, every step back to its base, and that base a full step, each with the checksum the delta
names. A delta that passes only some of these is refused with 424 at once, so the pusher learns it now
rather than a restore failing on the step later."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from elastic_rm.checkpoint.manifest import file_entry, make_manifest, step_dirname
from elastic_rm.checkpoint.store import CheckpointStore, Refused


def push(store: CheckpointStore, tmp: Path, step: int, link: dict[str, Any]) -> tuple[int, str]:
    """Upload and commit one step of n1 holding a small file; returns (step, manifest digest)."""
    src = tmp / "src" / step_dirname(step)
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir(parents=True)
    data = bytes([step % 256]) * 100
    (src / "__0_delta.erm").write_bytes(data)
    body = make_manifest(
        {
            "step": step,
            "world_size": 1,
            "nodes": ["n1"],
            "position": {"step": step},
            "files": {"__0_delta.erm": file_entry(src / "__0_delta.erm", node="n1", rank=0)},
            **link,
        }
    )
    store.begin("n1", step)
    store.receive("n1", step, "__0_delta.erm", len(data), io.BufferedReader(io.BytesIO(data)))
    store.commit("n1", step, body, keep=5)
    return step, json.loads(body)["manifest_sha256"]


def delta(base: tuple[int, str], parent: tuple[int, str]) -> dict[str, Any]:
    return {
        "kind": "delta",
        "base": base[0],
        "base_sha256": base[1],
        "parent": parent[0],
        "parent_sha256": parent[1],
    }


def refused(store: CheckpointStore, tmp: Path, step: int, link: dict[str, Any]) -> int:
    with pytest.raises(Refused) as error:
        push(store, tmp, step, link)
    assert not (tmp / "n0" / "replicas" / "n1" / step_dirname(step)).exists()
    return error.value.code


def test_a_delta_on_the_last_commit_is_checked_against_its_whole_chain(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path / "n0")
    root = tmp_path / "n0" / "replicas" / "n1"
    first = push(store, tmp_path, 1, {})
    second = push(store, tmp_path, 2, delta(first, first))
    third = push(store, tmp_path, 3, delta(first, second))

    # its base a delta (step 2), not the full step its parent's chain rests on
    assert refused(store, tmp_path, 4, delta(second, third)) == 424
    # a new base at 5: a delta on it naming the older base 1
    fifth = push(store, tmp_path, 5, {})
    assert refused(store, tmp_path, 6, delta(first, fifth)) == 424
    sixth = push(store, tmp_path, 6, delta(fifth, fifth))
    seventh = push(store, tmp_path, 7, delta(fifth, sixth))

    # a middle step gone (removed outside the store) under a parent and base that are still there
    shutil.rmtree(root / step_dirname(6))
    assert refused(store, tmp_path, 8, delta(fifth, seventh)) == 424
    # and the base gone: refused too
    shutil.rmtree(root / step_dirname(5))
    assert refused(store, tmp_path, 8, delta(fifth, seventh)) == 424
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == [
        step_dirname(s) for s in (1, 2, 3, 7)
    ]
