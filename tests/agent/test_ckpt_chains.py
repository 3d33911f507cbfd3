"""Delta steps through the agent's checkpoint server (real server processes on loopback): a delta's
replica is accepted only on top of its chain, the pusher completes a chain the peer lacks from its own
memory, pruning keeps whole chains, and the retention rule the writers share."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from elastic_rm.checkpoint.local_servers import NodeServer, node_servers
from elastic_rm.checkpoint.manifest import MANIFEST, committed_steps, file_entry, make_manifest, step_dirname
from elastic_rm.checkpoint.peers import CHAIN_MISSING, PeerClient, PeerEndpoint, PeerError
from elastic_rm.checkpoint.retention import chain, missing_from, prune_chains, read_links, steps_to_keep


class Chain:
    """Steps written into one node's memory directory as the flash checkpoint lays them out: a full
    step holds big files and .metadata, a delta step one small file per rank and names its parent."""

    def __init__(self, node_dir: Path, node: str = "n0", run: str = "run-a") -> None:
        self.dir, self.node, self.run = node_dir, node, run
        self.shas: dict[int, str] = {}
        self.base: int | None = None
        self.last: int | None = None

    def full(self, step: int, size: int = 1 << 20) -> bytes:
        files = {f"__0_{step}.distcp": os.urandom(size), ".metadata": self.run.encode()}
        body = self._write(step, files, {"kind": "full"})
        self.base = step
        return body

    def delta(self, step: int, size: int = 4096) -> bytes:
        assert self.base is not None and self.last is not None
        fields = {
            "kind": "delta",
            "parent": self.last,
            "parent_sha256": self.shas[self.last],
            "base": self.base,
            "base_sha256": self.shas[self.base],
        }
        return self._write(step, {f"delta-r0-{step}.bin": os.urandom(size)}, fields)

    def _write(self, step: int, files: dict[str, bytes], fields: dict) -> bytes:
        d = self.dir / step_dirname(step)
        d.mkdir(parents=True)
        for name, data in files.items():
            (d / name).write_bytes(data)
        entries = {n: file_entry(d / n, node="*" if n == ".metadata" else self.node, rank=0) for n in files}
        body = make_manifest(
            {"step": step, "world_size": 1, "nodes": [self.node], "position": {"run": self.run}}
            | {"files": entries, **fields}
        )
        (d / MANIFEST).write_bytes(body)
        self.shas[step] = json.loads(body)["manifest_sha256"]
        self.last = step
        return body

    def push(self, c: PeerClient, step: int, keep: int = 2) -> int:
        d = self.dir / step_dirname(step)
        body = (d / MANIFEST).read_bytes()
        names = sorted(json.loads(body)["files"])
        return c.push_replica(self.node, step, d, names, body, keep=keep)


@pytest.fixture
def servers(tmp_path: Path):
    root = tmp_path / "shm"
    with node_servers(root, ["n0", "n1"]) as s:
        yield root, s


def _client(s: NodeServer) -> PeerClient:
    return PeerClient(PeerEndpoint(s.node, s.url, s.token), timeout_s=60)


def _sizes(step_dir: Path) -> int:
    return sum(p.stat().st_size for p in step_dir.iterdir() if p.name != MANIFEST)


def test_only_the_delta_crosses_and_pruning_keeps_the_chain(servers) -> None:
    root, s = servers
    mine = Chain(root / "n0")
    c = _client(s["n1"])
    held = root / "n1" / "replicas" / "n0"
    full_bytes = mine.full(10)
    assert json.loads(full_bytes)["kind"] == "full"
    assert mine.push(c, 10) > 1 << 20
    for step in range(11, 16):
        mine.delta(step)
        sent = mine.push(c, step)
        assert sent == _sizes(root / "n0" / step_dirname(step)) < 8192  # the delta's file only
    # keep=2 would drop all but two full steps; a chain keeps its base and every delta
    assert committed_steps(held) == [10, 11, 12, 13, 14, 15]
    links = read_links(held)
    assert chain(links, 15) == [10, 11, 12, 13, 14, 15]
    # a new base: the old chain goes once the new one has `keep` restorable steps
    mine.full(16)
    mine.push(c, 16)
    assert committed_steps(held) == [10, 11, 12, 13, 14, 15, 16]  # 16 alone is one restorable step
    mine.delta(17)
    mine.push(c, 17)
    assert committed_steps(held) == [16, 17]
    # what the peer serves of a delta step: its manifest and its file, for a restore after a loss
    got = root / "got"
    assert c.manifest(17) == (root / "n0" / step_dirname(17) / MANIFEST).read_bytes()
    assert c.download(17, "delta-r0-17.bin", got / "d") == 4096
    assert (got / "d").read_bytes() == (root / "n0" / step_dirname(17) / "delta-r0-17.bin").read_bytes()
    # past a base and `keep` steps a commit prunes nothing; the next base's chain prunes again
    for step in (18, 19, 20):
        mine.delta(step)
        mine.push(c, step)
    assert committed_steps(held) == [16, 17, 18, 19, 20]
    mine.full(21)
    mine.push(c, 21)
    mine.delta(22)
    mine.push(c, 22)
    assert committed_steps(held) == [21, 22]


def test_a_delta_without_its_chain_is_refused_then_pushed_with_it(servers) -> None:
    """A new ring peer holds nothing of this node: the first delta it gets is refused (424) and the
    pusher sends the missing chain from its memory, base first."""
    root, s = servers
    mine = Chain(root / "n0")
    mine.full(20)
    for step in (21, 22, 23):
        mine.delta(step)
    c = _client(s["n1"])
    held = root / "n1" / "replicas" / "n0"
    # the raw refusal: the commit names the missing chain and publishes nothing
    d = root / "n0" / step_dirname(23)
    with pytest.raises(PeerError, match="delta of step 22 .base 20.*push the chain") as err:
        c._push_step("n0", 23, d, ["delta-r0-23.bin"], (d / MANIFEST).read_bytes(), keep=2)
    assert err.value.status == CHAIN_MISSING
    assert committed_steps(held) == []
    # push_replica completes the chain: the base's files, then every delta, and the step itself
    sent = mine.push(c, 23)
    assert sent == sum(_sizes(root / "n0" / step_dirname(x)) for x in (20, 21, 22, 23))
    assert committed_steps(held) == [20, 21, 22, 23]
    assert chain(read_links(held), 23) == [20, 21, 22, 23]
    # the next delta goes alone again
    mine.delta(24)
    assert mine.push(c, 24) == _sizes(root / "n0" / step_dirname(24))


def test_a_delta_of_another_checkpoint_is_refused(servers, tmp_path: Path) -> None:
    """The peer holds a step 30 of another run (or a replaced one): this run's delta of its own step
    30 does not go on top of it; the pusher replaces the chain, and the foreign step is gone."""
    root, s = servers
    c = _client(s["n1"])
    other = Chain(tmp_path / "other" / "n0", run="run-b")
    other.full(30)
    other.push(c, 30)
    mine = Chain(root / "n0")
    mine.full(30)
    mine.delta(31)
    d = root / "n0" / step_dirname(31)
    with pytest.raises(PeerError) as err:
        c._push_step("n0", 31, d, ["delta-r0-31.bin"], (d / MANIFEST).read_bytes(), keep=2)
    assert err.value.status == CHAIN_MISSING and "another checkpoint" in str(err.value)
    mine.push(c, 31)
    held = root / "n1" / "replicas" / "n0"
    assert json.loads((held / step_dirname(30) / MANIFEST).read_bytes())["position"] == {"run": "run-a"}
    assert chain(read_links(held), 31) == [30, 31]


def test_a_chain_that_is_broken_at_the_source_is_an_error(servers) -> None:
    root, s = servers
    mine = Chain(root / "n0")
    mine.full(40)
    mine.delta(41)
    mine.delta(42)
    (root / "n0" / step_dirname(41) / MANIFEST).unlink()  # the node's own chain is incomplete
    with pytest.raises(PeerError, match="step 42: its chain of checkpoints is incomplete"):
        mine.push(_client(s["n1"]), 42)


def test_retention_rule(tmp_path: Path) -> None:
    d = tmp_path / "n0"
    mine = Chain(d)
    mine.full(1)
    mine.full(2)
    mine.full(3)
    assert steps_to_keep(read_links(d), 2) == {2, 3}  # full steps only: the newest `keep`
    for step in (4, 5, 6):
        mine.delta(step)
    assert steps_to_keep(read_links(d), 2) == {3, 4, 5, 6}
    assert steps_to_keep(read_links(d), 5) == {2, 3, 4, 5, 6}
    # a broken link: 6 and 5 cannot be restored (5's manifest is gone), 4 can, with its base
    (d / step_dirname(5) / MANIFEST).unlink()
    links = read_links(d)
    assert chain(links, 6) is None and chain(links, 4) == [3, 4]
    assert steps_to_keep(links, 2) == {3, 4}  # 4 and 3 are the two newest restorable steps
    # prune removes what no kept chain needs, older than the newest kept step; newer steps stay
    (d / (step_dirname(2) + ".tmp")).mkdir()  # a writer's leftover, older than the newest kept step
    assert prune_chains(d, 1) == [1, 2]
    assert committed_steps(d) == [3, 4, 5, 6]
    assert not (d / (step_dirname(2) + ".tmp")).exists()


def test_missing_from_names_what_a_copy_lacks(tmp_path: Path) -> None:
    """What a durable directory (or a peer) needs so that a step restores there: the chain's steps it
    does not hold as the same checkpoint, base first."""
    mem, durable = tmp_path / "mem", tmp_path / "durable"
    mine = Chain(mem)
    mine.full(50)
    for step in (51, 52, 53):
        mine.delta(step)
    assert missing_from(read_links(mem), read_links(durable), 53) == [50, 51, 52, 53]
    for step in (50, 51):
        (durable / step_dirname(step)).mkdir(parents=True)
        for p in (mem / step_dirname(step)).iterdir():
            (durable / step_dirname(step) / p.name).write_bytes(p.read_bytes())
    assert missing_from(read_links(mem), read_links(durable), 53) == [52, 53]
    with pytest.raises(ValueError, match="step 99"):
        missing_from(read_links(mem), read_links(durable), 99)
