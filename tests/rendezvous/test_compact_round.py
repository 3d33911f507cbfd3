"""The round value of a big run: long node lists compressed (version 2), read back exactly, and every
malformed form a clear error.

Why: at 1,024 nodes the round value was 35 KB, sent to every node's watch on each change."""

from __future__ import annotations

import base64
import json
import zlib

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.status import job_status
from elastic_rm.rendezvous.view import JobView
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.node_lists import COMPACT_AT, MAX_BYTES
from elastic_rm.wire.records import RecordError, RoundRecord

KEY = "/elastic-rm/r/round"


def _big(n: int = 1024, standby: int = 100) -> RoundRecord:
    ids = [f"gpu-node-{i:04d}-{31000 + i * 7}-{i * 2654435761 % 16**6:06x}" for i in range(n + standby)]
    return RoundRecord(
        round=7,
        members=tuple(ids[:n]),
        standby=tuple(ids[n:]),
        reason="lost a node",
        leader=ids[0],
        sealed=True,
        master=("10.0.0.1", 29500),
        time=1.5,
        extra={"alive": []},
    )


def test_a_big_round_is_compressed_and_reads_back_exactly():
    record = _big()
    raw = record.to_json()
    plain = json.dumps(json.loads(raw.replace(b'"v":2', b'"v":1')))  # for the size only
    body = json.loads(raw)
    assert body["v"] == 2 and "members" not in body and "members_z" in body and "standby_z" in body
    assert body["world_size"] == 1024  # readable without decoding
    assert len(raw) < len(plain) and len(raw) * 2 < len(json.dumps({"m": record.members + record.standby}))
    assert RoundRecord.parse(KEY, raw) == record


def test_a_small_round_stays_plain_json_of_version_1():
    record = RoundRecord(round=2, members=tuple(f"n{i}" for i in range(COMPACT_AT - 1)), standby=("s",))
    body = json.loads(record.to_json())
    assert body["v"] == 1 and body["members"][0] == "n0" and body["standby"] == ["s"]
    assert RoundRecord.parse(KEY, record.to_json()) == record


def _with(**fields) -> bytes:
    body = json.loads(_big().to_json())
    body.update(fields)
    return json.dumps(body).encode()


def _z(data: bytes) -> str:
    return base64.b64encode(zlib.compress(data)).decode()


@pytest.mark.parametrize(
    "raw,message",
    [
        (_with(members_z="%%%not base64"), "not base64 of zlib"),
        (_with(members_z=base64.b64encode(b"plain, not zlib").decode()), "not base64 of zlib"),
        (_with(members_z=_z(b"a\nb")[:-8]), "truncated|not base64"),
        (_with(members_z=_z(b"a\n" * (MAX_BYTES // 2 + 10))), "more than"),
        (_with(members_z=_z(b"a\na")), "repeats a node id"),
        (_with(members_z=_z(b"a\n\nb")), "list of node ids"),
        (_with(members_z=_z(b"\xff\xfe")), "not UTF-8"),
        (_with(members_z=12), "wrong type"),
        (_with(members=["a"]), "both 'members' and 'members_z'"),
        (_with(v=3), "unsupported record version 3"),
    ],
)
def test_a_malformed_compressed_round_is_a_clear_error(raw, message):
    with pytest.raises(RecordError, match=message) as err:
        RoundRecord.parse(KEY, raw)
    assert KEY in str(err.value)


def test_only_round_records_take_version_2():
    from elastic_rm.wire.records import NodeRecord

    raw = json.dumps(
        {"v": 2, "node": "n", "host": "h", "addr": "a", "pid": 1, "nproc": 1, "state": "joining"}
    )
    with pytest.raises(RecordError, match="unsupported record version 2"):
        NodeRecord.parse("/elastic-rm/r/nodes/n", raw.encode())


def test_a_compressed_round_in_etcd_reaches_the_view_and_erm_status(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    record = _big(200, 0)
    with EtcdClient(etcd.endpoint, timeout=10) as c:
        c.put(keys.round, record.to_json())
        view = JobView(c, keys)
        view.start()
        try:
            assert view.round == record and view.error is None
            status = job_status(c, keys)
            assert status["world_size"] == 200 and len(status["members"]) == 200
            assert status["members"][5]["rank"] == 5
        finally:
            view.stop()
