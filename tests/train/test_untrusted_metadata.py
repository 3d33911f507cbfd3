"""No bytes of a checkpoint reach pickle unrestricted: DCP's `.metadata` (a pickle) is read admitting only
DCP's metadata classes, locally and from a peer node's checkpoint server; a forged one that would run
code is refused and the code does not run."""

from __future__ import annotations

import io
import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from erm_harness import run_world
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_train_reshard import TABLES, pinned
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from elastic_rm.checkpoint.dcp_metadata import SafeMetadataReader, UnsafeCheckpointError, loads_metadata
from elastic_rm.checkpoint.local_servers import node_servers, peer_lists
from elastic_rm.checkpoint.manifest import file_entry, make_manifest, step_dirname


class _RunsCode:
    """Unpickled, this calls os.system: what a forged .metadata would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def forged_metadata(marker: Path, real: Metadata) -> bytes:
    """A real checkpoint's metadata with a payload hidden where DCP keeps free-form data."""
    real.planner_data = {"x": _RunsCode(marker)}
    return pickle.dumps(real)


def test_a_payload_that_runs_code_is_real(tmp_path: Path) -> None:
    """The payload the tests below refuse does run code under plain pickle (so their check can fail)."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(_RunsCode(marker)))
    assert marker.exists()


def test_real_metadata_reads_as_dcp_reads_it_and_forged_ones_are_refused(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    dcp.save(state, checkpoint_id=ckpt)
    safe = SafeMetadataReader(ckpt).read_metadata()
    assert safe.state_dict_metadata == FileSystemReader(ckpt).read_metadata().state_dict_metadata
    assert isinstance(safe.state_dict_metadata["b"], TensorStorageMetadata)
    assert safe.state_dict_metadata["b"].properties.dtype == torch.bfloat16
    loaded = {"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}
    dcp.load(loaded, storage_reader=SafeMetadataReader(ckpt))
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    marker = tmp_path / "ran"
    real = (ckpt / ".metadata").read_bytes()
    hostile = {
        "hidden in planner_data": forged_metadata(marker, pickle.loads(real)),
        "the whole file": pickle.dumps(_RunsCode(marker)),
        "eval": pickle.dumps(eval),
    }
    for what, data in hostile.items():
        with pytest.raises(UnsafeCheckpointError, match=r"refused: DCP \.metadata names (posix|builtins)"):
            loads_metadata(data, what)
    with pytest.raises(UnsafeCheckpointError, match="not DCP checkpoint metadata"):
        loads_metadata(pickle.dumps({"state_dict_metadata": {}}), "a dict")
    with pytest.raises(UnsafeCheckpointError, match="does not parse"):
        loads_metadata(real[: len(real) // 2], "torn")
    (ckpt / ".metadata").write_bytes(hostile["hidden in planner_data"])
    with pytest.raises(CheckpointException, match="refused: DCP .metadata names posix.system"):
        dcp.load(loaded, storage_reader=SafeMetadataReader(ckpt))
    assert not marker.exists()


def test_a_byte_item_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """DCP reads byte items with torch.load(weights_only=False): a checkpoint declaring one is refused."""
    ckpt = tmp_path / "ckpt"
    dcp.save({"w": torch.ones(2), "note": "any object"}, checkpoint_id=ckpt)
    with pytest.raises(CheckpointException, match="declares 'note' as pickled bytes"):
        dcp.load({"w": torch.zeros(2), "note": ""}, storage_reader=SafeMetadataReader(ckpt))


def _spec(phases: list[dict]) -> dict:
    return {
        "tables": TABLES,
        "optim": "adagrad",
        "data_parallel": ["t3"],
        "column_wise": {},
        "phases": phases,
    }


@pytest.mark.slow  # 19 s; CI keeps the forged metadata refused by the same reader above
def test_a_peer_serving_forged_metadata_with_a_matching_manifest_is_refused(tmp_path: Path) -> None:
    """Node n1 saves a checkpoint; node n0, with no copy of its own, restores it from n1's checkpoint
    server over HTTP: first as saved (it loads), then with n1's .metadata replaced by one that would run
    code and the manifest rewritten so that its checksums match: the restore refuses the step, naming
    the global it refused, and the code never runs."""
    shm = tmp_path / "shm"
    marker = tmp_path / "ran"
    flash = {"memory_root": str(shm), "durable_dir": None}
    save = {"world": 1, "nodes": ["n1"], "pinned": pinned(1), "flash": flash}
    restore = {"world": 1, "nodes": ["n0"], "pinned": pinned(1), "flash": flash}
    with node_servers(shm, ["n0", "n1"]) as servers:
        peers = peer_lists(servers, ["n0", "n1"])
        first = run_world(
            1,
            _spec(
                [
                    {
                        **save,
                        "actions": [{"do": "init"}, {"do": "train", "seeds": [1]}, {"do": "save", "step": 3}],
                    },
                    {**restore, "peers": peers, "actions": [{"do": "restore"}]},
                ]
            ),
            tmp_path / "w1",
        )
        ok = first[0][1]["restores"][0]
        assert ok["step"] == 3 and ok["sources"] == ["peer:n1"], ok

        step_dir = shm / "n1" / step_dirname(3)
        manifest = json.loads((step_dir / "manifest.json").read_bytes())
        real = loads_metadata((step_dir / ".metadata").read_bytes(), "saved")
        (step_dir / ".metadata").write_bytes(forged_metadata(marker, real))
        manifest["files"][".metadata"] = file_entry(step_dir / ".metadata", node="*", rank=0)
        body = {k: v for k, v in manifest.items() if k not in ("v", "format", "manifest_sha256")}
        (step_dir / "manifest.json").write_bytes(make_manifest(body))
        assert not (shm / "n0").exists() or not any((shm / "n0").glob("step-*"))

        second = run_world(
            1, _spec([{**restore, "peers": peers, "actions": [{"do": "restore"}]}]), tmp_path / "w2"
        )
    err = second[0][0]["restores"][0].get("error", "")
    assert "no good checkpoint" in err and "step 3" in err, err
    assert "refused: DCP .metadata names posix.system" in err, err
    assert not marker.exists()


def _real_metadata_bytes() -> bytes:
    buf = io.BytesIO()
    md = Metadata(
        state_dict_metadata={
            "w": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([4, 2]),
                [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
            )
        },
        storage_data={MetadataIndex("w", [0, 0]): _StorageInfo("__0_0.distcp", 0, 100)},
        storage_meta=StorageMeta(checkpoint_id=Path("/x")),
    )
    pickle.dump(md, buf)
    return buf.getvalue()


REAL = _real_metadata_bytes()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.binary(max_size=2000)
    | st.lists(st.tuples(st.integers(0, len(REAL) - 1), st.integers(0, 255)), min_size=1, max_size=8).map(
        lambda flips: bytes(b if i not in dict(flips) else dict(flips)[i] for i, b in enumerate(REAL))
    )
)
def test_garbage_and_flipped_metadata_parse_or_fail_with_the_readers_own_error(data: bytes) -> None:
    try:
        md = loads_metadata(data, "fuzz")
    except UnsafeCheckpointError as e:
        assert "fuzz" in str(e)
    else:
        assert isinstance(md, Metadata)
