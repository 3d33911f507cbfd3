"""A replica delta's commit checks that its chain is held here without reading every step of it
(elastic_rm.checkpoint.store): a chain of a checkpoint per step holds hundreds of steps, and the server
commits one at every step. A delta on the step committed last looks at its parent and base only; any
other delta, or one whose parent or base has gone, is checked against the whole chain (and refused
with 424 when it is not held)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from elastic_rm.checkpoint import store as store_module
from elastic_rm.checkpoint.manifest import file_entry, make_manifest, step_dirname
from elastic_rm.checkpoint.store import CheckpointStore, Refused


def push(store: CheckpointStore, tmp: Path, step: int, link: dict[str, Any]) -> str:
    """Upload and commit one step of n1 holding a small file; returns its manifest digest."""
    src = tmp / "src" / step_dirname(step)
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
    store.commit("n1", step, body, keep=1)
    return json.loads(body)["manifest_sha256"]


def delta(base: tuple[int, str], parent: tuple[int, str]) -> dict[str, Any]:
    return {
        "kind": "delta",
        "base": base[0],
        "base_sha256": base[1],
        "parent": parent[0],
        "parent_sha256": parent[1],
    }


def test_a_delta_on_the_last_commit_reads_no_other_step_and_a_broken_chain_is_still_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = CheckpointStore(tmp_path / "n0")
    base = (1, push(store, tmp_path, 1, {}))
    top = base
    for step in range(2, 8):
        top = (step, push(store, tmp_path, step, delta(base, top)))
    listed: list[Path] = []
    real = store_module.read_links
    monkeypatch.setattr(store_module, "read_links", lambda d: listed.append(d) or real(d))
    top = (8, push(store, tmp_path, 8, delta(base, top)))
    assert listed == []  # the chain's steps were not listed: it extends the step committed last
    root = tmp_path / "n0" / "replicas" / "n1"
    assert [p.name for p in sorted(root.iterdir())] == [step_dirname(s) for s in range(1, 9)]

    # a delta on another step than the last: the whole chain is looked at (and held: committed)
    seventh = json.loads((root / step_dirname(7) / "manifest.json").read_bytes())["manifest_sha256"]
    ninth = (9, push(store, tmp_path, 9, delta(base, (7, seventh))))
    assert listed == [root]

    # the base gone (removed outside the store): the next delta is refused, its chain is not held
    shutil.rmtree(root / step_dirname(1))
    with pytest.raises(Refused) as refused:
        push(store, tmp_path, 10, delta(base, ninth))
    assert refused.value.code == 424
    assert not (root / step_dirname(10)).exists()
