"""The chain fields of a step's manifest are read once per version of the file: retention and a replica's
commit look at every step of a chain at every save, and a checkpoint per step makes chains long."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from elastic_rm.checkpoint import manifest
from elastic_rm.checkpoint.manifest import chain_fields, publish_dir, step_dirname
from elastic_rm.checkpoint.retention import read_links
from tests.train.test_ckpt_transport import make_step


def test_unchanged_manifests_are_not_read_again_and_a_replaced_one_is(tmp_path: Path, monkeypatch) -> None:
    node = tmp_path / "n0"
    for step in (1, 2, 3):
        make_step(node, step, {"__0_0.distcp": bytes([step]) * 100})
    links = read_links(node)
    assert sorted(links) == [1, 2, 3] and all(link.kind == "full" for link in links.values())

    def unread(path, *args, **kwargs):
        raise AssertionError(f"{path} read again")

    with monkeypatch.context() as m:
        m.setattr(manifest, "open", unread, raising=False)  # the module's reads go through open()
        assert read_links(node) == links  # from the cache: no manifest was opened

    # step 2 published again (another checkpoint of the same step): its new manifest is read
    other = tmp_path / "other"
    make_step(other, 2, {"__0_0.distcp": b"new" * 50})
    publish_dir(other / step_dirname(2), node / step_dirname(2), sync=False)
    again = read_links(node)
    assert again[2].sha != links[2].sha and again[1] == links[1] and again[3] == links[3]


def test_a_torn_manifest_is_skipped_like_before(tmp_path: Path) -> None:
    node = tmp_path / "n0"
    make_step(node, 1, {"__0_0.distcp": b"a" * 10})
    make_step(node, 2, {"__0_0.distcp": b"b" * 10})
    (node / step_dirname(2) / "manifest.json").write_bytes(b'{"step": 2, "files": {')
    assert sorted(read_links(node)) == [1]
    with pytest.raises(ValueError):
        chain_fields(node / step_dirname(2))


def test_a_manifest_rewritten_with_the_same_size_and_modification_time_is_read_again(tmp_path: Path) -> None:
    """Coarse timestamps (or an inode reused after a removal) can give a new manifest the old one's
    inode, size and modification time: the change time still tells them apart."""
    node = tmp_path / "n0"
    make_step(node, 1, {"__0_0.distcp": b"a" * 100})
    path = node / step_dirname(1) / manifest.MANIFEST
    body = path.read_bytes()
    first = chain_fields(node / step_dirname(1))
    old = path.stat()
    other = body.replace(first["manifest_sha256"].encode(), b"f" * len(first["manifest_sha256"]))
    assert len(other) == len(body) and other != body
    for _ in range(200):  # until the file system's clock moves on (its change time is coarse)
        with open(path, "r+b") as f:  # in place: the same inode
            f.write(other)
        os.utime(path, ns=(old.st_atime_ns, old.st_mtime_ns))
        if path.stat().st_ctime_ns != old.st_ctime_ns:
            break
        time.sleep(0.01)
    now = path.stat()
    assert (now.st_ino, now.st_size, now.st_mtime_ns) == (old.st_ino, old.st_size, old.st_mtime_ns)
    assert chain_fields(node / step_dirname(1))["manifest_sha256"] == "f" * len(first["manifest_sha256"])


def test_each_manifest_versions_link_is_made_once(tmp_path: Path, monkeypatch) -> None:
    """read_links builds a step's Link once per version of its manifest: a listing of a long chain at
    every commit then costs a stat per step, and a replaced manifest gets a new Link."""
    from elastic_rm.checkpoint import retention

    node = tmp_path / "n0"
    for step in (1, 2, 3):
        make_step(node, step, {"__0_0.distcp": bytes([step]) * 100})
    made: list[int] = []
    real = retention.link_of
    monkeypatch.setattr(retention, "link_of", lambda doc: made.append(doc["step"]) or real(doc))
    links = read_links(node)
    assert sorted(made) == [1, 2, 3]
    assert read_links(node) == links and sorted(made) == [1, 2, 3]  # none made again

    other = tmp_path / "other"
    make_step(other, 2, {"__0_0.distcp": b"new" * 50})
    publish_dir(other / step_dirname(2), node / step_dirname(2), sync=False)
    assert read_links(node)[2].sha != links[2].sha and sorted(made) == [1, 2, 2, 3]
