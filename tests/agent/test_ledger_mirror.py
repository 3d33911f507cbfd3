"""The leader's etcd copy of the sample ledger: taken only from committed checkpoint manifests, written
only while leading and under the election's fence, and by a standby leader from a member's checkpoint
server. Real etcd, real manifests, a real checkpoint server."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from elastic_rm.agent.ledger_mirror import LedgerMirror, ledger_record
from elastic_rm.checkpoint.manifest import make_manifest, step_dirname
from elastic_rm.checkpoint.peers import PeerEndpoint
from elastic_rm.checkpoint.server import CheckpointServer
from elastic_rm.etcd.client import EtcdClient, Op
from elastic_rm.etcd.lease import Election
from elastic_rm.train.ledger import GlobalBatches, LedgerError, RangeLedger
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import LedgerRecord, RecordError

BATCH, RANGE = 8, 32  # samples per global batch and per ledger range


def ledger_after(steps: int) -> dict:
    batches = GlobalBatches(RangeLedger(320, RANGE), BATCH)
    for _ in range(steps):
        batches.next()
        batches.consumed()
    return batches.ledger.checkpoint_state()


def commit(node_dir: Path, step: int, position: dict, timeline: dict | None = None) -> None:
    d = node_dir / step_dirname(step)
    d.mkdir(parents=True)
    body = {"step": step, "world_size": 1, "nodes": ["n0"], "position": position, "files": {}}
    if timeline is not None:
        body["timeline"] = timeline
    (d / "manifest.json").write_bytes(make_manifest(body))


class Leader:
    """A real election on a real lease; `publish` writes as RoundLeader.publish_ledger does (fenced)."""

    def __init__(self, client: EtcdClient, keys: Keyspace, node: str) -> None:
        self.client, self.keys = client, keys
        lease, _ttl = client.lease_grant(30)
        self.election = Election(client, keys.leader, node, lease)
        self.leading = False

    def campaign(self) -> bool:
        self.leading = self.election.try_acquire()
        return self.leading

    def publish(self, record: LedgerRecord) -> bool:
        return self.client.txn(
            [self.election.fence()], [Op.put(self.keys.ledger, record.to_json())]
        ).succeeded


def read(client: EtcdClient, keys: Keyspace) -> LedgerRecord | None:
    kv = client.get(keys.ledger)
    return None if kv is None else LedgerRecord.parse(keys.ledger, kv.value)


def test_mirrors_committed_ledgers_only_while_leading(etcd, run_id, tmp_path, caplog):
    keys = Keyspace("/elastic-rm", run_id)
    node_dir = tmp_path / "n0"
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        leader = Leader(client, keys, "n0")
        mirror = LedgerMirror("n0", lambda: node_dir, leader.publish, lambda: leader.leading)
        commit(node_dir, 10, {"step": 10, "ledger": ledger_after(10)})
        assert mirror.poll() is None and read(client, keys) is None  # not leading: nothing written
        assert leader.campaign()
        rec = mirror.poll()
        assert rec is not None and read(client, keys) == rec
        assert (rec.step, rec.samples_done, rec.epoch, rec.epoch_samples) == (10, 10 * BATCH, 0, 320)
        assert mirror.poll() is None  # nothing new: no write
        # a step directory without its manifest is not committed: the ledger stays at step 10
        (node_dir / step_dirname(20)).mkdir()
        assert mirror.poll() is None and read(client, keys).step == 10
        (node_dir / step_dirname(20)).rmdir()
        # past an epoch: 45 steps of 8 over 320 samples = 1 epoch and 40 samples
        commit(node_dir, 45, {"step": 45, "ledger": ledger_after(45)})
        rec = mirror.poll()
        assert (rec.step, rec.epoch, rec.samples_done) == (45, 1, 45 * BATCH) and read(client, keys) == rec
        # a malformed ledger in a committed manifest: one warning, the etcd copy is left as it was
        commit(node_dir, 50, {"step": 50, "ledger": {"v": 1, "num_samples": "many"}})
        with caplog.at_level(logging.WARNING, logger="elastic_rm.agent.ledger_mirror"):
            assert mirror.poll() is None and mirror.poll() is None
        assert caplog.text.count("not mirroring the ledger of step 50") == 1
        assert read(client, keys).step == 45
        # deposed: another node leads now; our fenced write fails even though we still think we lead
        client.delete(keys.leader)
        other = Leader(client, keys, "n1")
        assert other.campaign()
        commit(node_dir, 60, {"step": 60, "ledger": ledger_after(60)})
        assert mirror.poll() is None and read(client, keys).step == 45


def test_after_a_restore_of_an_older_step_the_new_timelines_steps_are_mirrored(etcd, run_id, tmp_path):
    """A restore that went back from step 10 to step 5 saves steps 6, 7, ... again: they are newer than
    the mirrored step 10 (a newer timeline), so the etcd copy follows the model back instead of staying
    ahead of it until the new steps pass 10."""
    keys = Keyspace("/elastic-rm", run_id)
    node_dir = tmp_path / "n0"
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        leader = Leader(client, keys, "n0")
        assert leader.campaign()
        mirror = LedgerMirror("n0", lambda: node_dir, leader.publish, lambda: leader.leading)
        commit(node_dir, 10, {"step": 10, "ledger": ledger_after(10)})
        assert mirror.poll().step == 10
        shutil.rmtree(node_dir / step_dirname(10))  # the restore of step 5 dropped it
        forked = {"id": 1, "from": [[0, 5]]}
        commit(node_dir, 6, {"step": 6, "ledger": ledger_after(6)}, forked)
        rec = mirror.poll()
        assert (
            rec is not None and (rec.step, rec.samples_done) == (6, 6 * BATCH) and read(client, keys) == rec
        )
        assert mirror.poll() is None  # nothing new
        commit(node_dir, 7, {"step": 7, "ledger": ledger_after(7)}, forked)
        assert mirror.poll().step == 7 and read(client, keys).step == 7


@pytest.mark.parametrize(
    "member, holds_old_steps",
    [(True, False), (False, False), (False, True)],
    ids=["a-member-with-empty-memory", "a-standby", "a-standby-holding-old-steps"],
)
def test_a_leader_without_the_runs_steps_reads_a_members_checkpoint_server(
    etcd, run_id, tmp_path, member, holds_old_steps
):
    """A leader whose memory holds no step yet, or that sat the current round out, mirrors the members'
    newest checkpoint, read from their checkpoint servers; a standby does so also when its own memory
    holds steps from before (here a newer step number, of a timeline a restore abandoned since)."""
    keys = Keyspace("/elastic-rm", run_id)
    member_dir, standby_dir = tmp_path / "member", tmp_path / "standby"
    commit(member_dir, 35, {"step": 35, "ledger": ledger_after(35)}, {"id": 1, "from": [[0, 30]]})
    if holds_old_steps:
        commit(standby_dir, 40, {"step": 40, "ledger": ledger_after(40)})
    server = CheckpointServer(member_dir)
    server.start()
    try:
        peer = PeerEndpoint("member", f"http://127.0.0.1:{server.port}", server.token)
        with EtcdClient(etcd.endpoint, timeout=5) as client:
            leader = Leader(client, keys, "standby")
            assert leader.campaign()
            mirror = LedgerMirror(
                "standby", lambda: standby_dir, leader.publish, lambda: True, lambda: [peer], lambda: member
            )
            rec = mirror.poll()
            assert rec is not None and (rec.step, rec.samples_done) == (35, 35 * BATCH)
            assert read(client, keys) == rec
    finally:
        server.stop()


def test_ledger_record_and_batches_errors():
    with pytest.raises(LedgerError, match="malformed ledger state"):
        ledger_record(1, "n0", {"v": 1, "num_samples": -5})
    bad = b'{"v": 1, "step": 3, "node": "n0", "time": 1.0, "epoch": 0, "samples_done": -1, '
    bad += b'"epoch_samples": 9, "ledger": {}}'
    with pytest.raises(RecordError, match="negative count"):
        LedgerRecord.parse("/elastic-rm/r/ledger", bad)
    with pytest.raises(RecordError, match="missing field 'ledger'"):
        LedgerRecord.parse(
            "/elastic-rm/r/ledger",
            bad.replace(b'"samples_done": -1, ', b'"samples_done": 1, ').replace(b', "ledger": {}', b""),
        )
