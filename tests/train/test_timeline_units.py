"""The timeline rules (elastic_rm/checkpoint/timeline.py) and the directory reads retention makes of
them, on real manifests: which steps lie on the current history, how a restore forks, which timeline a
set of directories names (only from manifests that pass their checks), and what a restore drops."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from elastic_rm.checkpoint import timeline
from elastic_rm.checkpoint.local_servers import node_servers
from elastic_rm.checkpoint.manifest import CorruptCheckpointError, make_manifest, parse_manifest, step_dirname
from elastic_rm.checkpoint.peers import PeerEndpoint
from elastic_rm.checkpoint.retention import abandoned_steps, drop_newer_than, newest_timeline
from elastic_rm.checkpoint.sources import DirectorySource, HttpPeerSource, newest_timeline_of

T1 = (1, ((0, 3),))  # timeline 1: timeline 0 up to step 3, then its own steps
T2 = (2, ((0, 3), (1, 7)))


def m(step: int, key: timeline.Key | None) -> dict[str, Any]:
    doc: dict[str, Any] = {"step": step}
    if key is not None:
        doc["timeline"] = timeline.as_field(key)
    return doc


def write_step(directory: Path, step: int, key: timeline.Key | None) -> Path:
    d = directory / step_dirname(step)
    d.mkdir(parents=True)
    body = {"step": step, "world_size": 1, "position": {"step": step}, "files": {}}
    if key is not None:
        body["timeline"] = timeline.as_field(key)
    (d / "manifest.json").write_bytes(make_manifest(body))
    return d / "manifest.json"


def test_a_step_is_live_on_its_own_timeline_and_on_the_history_up_to_each_fork() -> None:
    assert timeline.is_live(T2, m(9, T2)) and timeline.is_live(T2, m(8, T2))
    assert timeline.is_live(T2, m(7, T1)) and timeline.is_live(T2, m(4, T1))
    assert not timeline.is_live(T2, m(8, T1))  # timeline 1 after the fork: abandoned
    assert timeline.is_live(T2, m(3, None)) and timeline.is_live(T2, m(1, timeline.ORIGIN))
    assert not timeline.is_live(T2, m(4, None)) and not timeline.is_live(T2, m(6, None))
    # another timeline 1 (another history) is not this one's ancestor, whatever its steps
    assert not timeline.is_live(T2, m(5, (1, ((0, 2),))))
    assert not timeline.is_live(T1, m(9, T2))  # a newer timeline than the current one


def test_a_fork_continues_the_restored_steps_history_with_a_new_id() -> None:
    assert timeline.forked(timeline.ORIGIN, m(3, None)) == T1
    assert timeline.forked(T1, m(7, T1)) == T2
    # restoring an ancestor's step (the current timeline's own steps were bad): the history is cut there
    assert timeline.forked(T2, m(2, None)) == (3, ((0, 2),))
    assert timeline.from_json(timeline.as_field(T2)) == T2
    assert timeline.from_json(None) is None and timeline.from_json({"id": "x", "from": []}) is None


@pytest.mark.parametrize(
    "value",
    [
        [1, 2],
        {"id": 1},
        {"id": -1, "from": []},
        {"id": True, "from": []},
        {"id": 1, "from": [[0]]},
        {"id": 1, "from": [[0, "3"]]},
        {"id": 1, "from": [[1, 3]]},  # names itself
        {"id": 3, "from": [[1, 3], [0, 2]]},  # not oldest first
    ],
)
def test_a_malformed_timeline_makes_the_manifest_malformed(value: Any) -> None:
    assert timeline.check_field(value) is not None
    body = json.loads(
        make_manifest({"step": 1, "world_size": 1, "position": {}, "files": {}, "timeline": value})
    )
    with pytest.raises(CorruptCheckpointError, match="timeline"):
        parse_manifest(json.dumps(body).encode(), "here")


def test_the_newest_timeline_comes_only_from_manifests_that_pass_their_checksum(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    write_step(a, 3, None)
    write_step(a, 4, T1)
    write_step(b, 4, None)
    assert newest_timeline([b]) == timeline.ORIGIN
    assert newest_timeline([a, b]) == T1
    torn = write_step(b, 9, T2)
    torn.write_bytes(torn.read_bytes().replace(b'"position"', b'"pozition"'))  # the checksum fails
    assert newest_timeline([a, b]) == T1
    assert newest_timeline([tmp_path / "none"]) is None


def test_a_restore_drops_the_newer_steps_and_those_of_an_abandoned_timeline(tmp_path: Path) -> None:
    d = tmp_path / "n1"
    for step in (3, 4, 5):
        write_step(d, step, None)  # timeline 0: steps 4 and 5 were abandoned by timeline 1's fork at 3
    write_step(d, 2, (1, ((0, 1),)))  # another history's step, numbered below the restored one
    assert abandoned_steps(d, T1) == [2, 4, 5]
    assert sorted(drop_newer_than(d, 4, T1)) == [2, 4, 5]
    assert [p.name for p in sorted(d.iterdir())] == [step_dirname(3)]
    assert drop_newer_than(d, 3) == []  # without a timeline, by number only


class ListedOnly:
    """A source passed to restore(sources=...) with only the three methods a source must have: it
    knows nothing of timelines (its manifests are read) and has no fork() (a chain's delta files are
    read from it on the restoring thread)."""

    def __init__(self, root: Path) -> None:
        self.name, self.inner = "custom", DirectorySource("custom", root)

    def steps(self) -> list[int]:
        return self.inner.steps()

    def manifest_bytes(self, step: int) -> bytes | None:
        return self.inner.manifest_bytes(step)

    def file_path(self, step: int, file: str) -> Path | None:
        return self.inner.file_path(step, file)


def test_the_vote_reads_a_peers_server_and_any_source(tmp_path: Path) -> None:
    """A peer's checkpoint server names the newest timeline of its memory and replicas in its listing."""
    shm = tmp_path / "shm"
    write_step(shm / "n0", 3, None)
    write_step(shm / "n0" / "replicas" / "n1", 5, T1)
    write_step(tmp_path / "custom", 9, T2)
    with node_servers(shm, ["n0"]) as servers:
        s = servers["n0"]
        peer = HttpPeerSource(PeerEndpoint("n0", s.url, s.token), tmp_path / "cache", timeout_s=60)
        try:
            assert peer.newest_timeline() == T1 and peer.steps() == [3, 5]
            assert newest_timeline_of([DirectorySource("local", shm / "n0"), peer]) == T1
            assert newest_timeline_of([peer, ListedOnly(tmp_path / "custom")]) == T2
        finally:
            peer.clear()
    assert newest_timeline_of([DirectorySource("none", tmp_path / "none")]) is None
