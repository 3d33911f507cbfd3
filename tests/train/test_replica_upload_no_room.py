"""A replica upload that runs out of room in the memory file system (the free space checked before it
went meanwhile: another upload, a worker's save) is refused with 507, as one short of room from the
start is, not a 500 with a traceback in the agent's log; and a commit whose manifest cannot be written
removes the upload's files, which nothing else removed before a later prune."""

from __future__ import annotations

import errno
import io
from pathlib import Path

import pytest

from elastic_rm.checkpoint import store as store_mod
from elastic_rm.checkpoint.manifest import file_entry, make_manifest, step_dirname
from elastic_rm.checkpoint.store import CheckpointStore, Refused


class FullFile(io.RawIOBase):
    """A file that takes `room` bytes, then fails its writes like a full tmpfs."""

    def __init__(self, path: Path, room: int) -> None:
        self.f, self.room = open(path, "wb"), room  # noqa: SIM115 - closed by close()

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def close(self) -> None:
        self.f.close()
        super().close()


def upload(store: CheckpointStore, tmp: Path, data: bytes) -> bytes:
    """Begin step 4 from n1 and upload its one file; returns its manifest."""
    src = tmp / "src"
    src.mkdir(exist_ok=True)
    (src / "__0_0.distcp").write_bytes(data)
    body = make_manifest(
        {
            "step": 4,
            "world_size": 1,
            "nodes": ["n1"],
            "position": {"step": 4},
            "files": {"__0_0.distcp": file_entry(src / "__0_0.distcp", node="n1", rank=0)},
        }
    )
    store.begin("n1", 4)
    store.receive("n1", 4, "__0_0.distcp", len(data), io.BufferedReader(io.BytesIO(data)))
    return body


def test_an_upload_that_runs_out_of_room_is_refused_with_507(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path / "n0")
    monkeypatch.setattr(store_mod, "open", lambda path, mode: FullFile(path, 1000), raising=False)
    with pytest.raises(Refused, match=r"__0_0.distcp: no room left") as error:
        upload(store, tmp_path, b"x" * 5000)
    assert error.value.code == 507
    tmp = tmp_path / "n0" / "replicas" / "n1" / (step_dirname(4) + ".tmp")
    assert list(tmp.iterdir()) == []  # the part written is gone
    monkeypatch.undo()
    body = upload(store, tmp_path, b"x" * 5000)  # room again: the same push goes through
    store.commit("n1", 4, body, keep=2)
    assert store.listing()["replicas"] == {"n1": [4]}


def test_a_commit_without_room_for_its_manifest_drops_the_upload(tmp_path: Path, monkeypatch) -> None:
    store = CheckpointStore(tmp_path / "n0")
    body = upload(store, tmp_path, b"y" * 3000)

    def full(path: Path, data: bytes, sync: bool) -> None:
        path.write_bytes(data[:10])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_mod, "write_file", full)
    with pytest.raises(Refused, match="no room left for its manifest") as error:
        store.commit("n1", 4, body, keep=2)
    assert error.value.code == 507
    assert list((tmp_path / "n0" / "replicas" / "n1").iterdir()) == []  # its 3000 bytes went too
    monkeypatch.undo()
    body = upload(store, tmp_path, b"y" * 3000)
    store.commit("n1", 4, body, keep=2)
    assert store.listing()["replicas"] == {"n1": [4]}
