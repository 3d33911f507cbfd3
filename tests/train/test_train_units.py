"""In-process tests of the pure parts: elastic sharding rules and plans, manifests, the ledger, data."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from elastic_rm.checkpoint.manifest import (
    CorruptCheckpointError,
    file_entry,
    make_manifest,
    parse_manifest,
    verify_file,
)
from elastic_rm.train.data import CriteoTSVReader, SyntheticClickData, write_criteo_tsv, zipf_head_share
from elastic_rm.train.ledger import JsonFileLedgerStore, LedgerError, RangeLedger
from elastic_rm.train.sharding import (
    ElasticPlanError,
    ElasticRules,
    WorldTopology,
    plan_sharding,
    plan_summary,
)


def tables() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=32, num_embeddings=1000 * (i + 1), feature_names=[f"f{i}"]
        )
        for i in range(4)
    ]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables(), device=torch.device("meta"))


RULES = ElasticRules(data_parallel=frozenset({"t3"}), column_wise={"t2": 8})


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_plan_keeps_elastic_invariants_at_every_world(world: int) -> None:
    plan = plan_summary(
        plan_sharding(Net(), WorldTopology(world, world), RULES, check_same_on_all_ranks=False)
    )
    p = plan["ebc"]
    assert p["t3"]["type"] == "data_parallel"
    assert p["t2"]["type"] == "column_wise" and len({s[1] for s in p["t2"]["shards"]}) == 4
    for name in ("t0", "t1"):
        assert p[name]["type"] in ("table_wise", "row_wise")
        assert {s[1] for s in p[name]["shards"]} == {0}  # one column shard
        assert all(0 <= s[4] < world for s in p[name]["shards"])


def test_pinned_row_wise_is_planned_on_cpu() -> None:
    rules = ElasticRules(pinned={"t0": ["rw"], "t1": ["tw"]})
    p = plan_summary(plan_sharding(Net(), WorldTopology(3, 3), rules, check_same_on_all_ranks=False))["ebc"]
    assert p["t0"]["type"] == "row_wise" and len(p["t0"]["shards"]) == 3
    assert p["t1"]["type"] == "table_wise"


@pytest.mark.parametrize(
    "rules, match",
    [
        (ElasticRules(column_wise={"t0": 12}), "multiple of 4"),
        (ElasticRules(column_wise={"t0": 24}), "divides"),
        (ElasticRules(data_parallel=frozenset({"t0"}), pinned={"t0": ["rw"]}), "data_parallel at every"),
        (ElasticRules(pinned={"t1": ["cw"]}), "sharded at every"),
        (ElasticRules(data_parallel=frozenset({"nope"})), "unknown tables"),
        (ElasticRules(data_parallel=frozenset({"t0"}), column_wise={"t0": 8}), "both"),
    ],
)
def test_rules_reject_what_breaks_resharding(rules: ElasticRules, match: str) -> None:
    with pytest.raises(ElasticPlanError, match=match):
        plan_sharding(Net(), WorldTopology(2, 2), rules, check_same_on_all_ranks=False)


def test_plan_fails_clearly_without_memory() -> None:
    with pytest.raises(ElasticPlanError, match="more memory per rank"):
        plan_sharding(
            Net(), WorldTopology(2, 2, memory_bytes_per_rank=10_000), RULES, check_same_on_all_ranks=False
        )


def test_manifest_self_checksum_and_file_verification(tmp_path: Path) -> None:
    f = tmp_path / "x.bin"
    f.write_bytes(b"abc" * 100)
    import hashlib

    entry = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "size": 300}
    raw = make_manifest({"step": 3, "world_size": 1, "position": {}, "files": {"x.bin": entry}})
    assert parse_manifest(raw, "t")["step"] == 3
    doc = json.loads(raw)
    doc["step"] = 4
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        parse_manifest(json.dumps(doc).encode(), "t")
    with pytest.raises(CorruptCheckpointError, match="not valid JSON"):
        parse_manifest(raw[:-10], "t")
    assert verify_file(f, entry) is None
    f.write_bytes(b"abd" + b"abc" * 99)
    assert "checksum mismatch" in (verify_file(f, entry) or "")
    f.write_bytes(b"abc")
    assert "truncated" in (verify_file(f, entry) or "")
    # what the flash checkpoint writes today: xxh3_128 for the file and for each block
    f.write_bytes(b"abc" * 100)
    current = file_entry(f)
    assert "xxh3_128" in current and "sha256" not in current and len(current["blocks"]) == 1
    assert verify_file(f, current) is None and verify_file(f, current, [(0, 10)]) is None
    f.write_bytes(b"abd" + b"abc" * 99)
    assert "checksum mismatch" in (verify_file(f, current) or "")
    assert "checksum mismatch in block 0" in (verify_file(f, current, [(0, 10)]) or "")
    f.unlink()
    assert verify_file(f, entry) == "missing"


# ---- ledger ---------------------------------------------------------------------------------------
OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "consume", "checkpoint", "crash", "leave"]),
        st.integers(0, 2),
        st.integers(1, 9),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 70), size=st.integers(1, 9), ops=OPS)
def test_ledger_exactly_once_through_checkpoints_and_crashes(n: int, size: int, ops: list) -> None:
    """Model state = multiset of consumed samples. Whatever the interleaving of work, checkpoints,
    crashes (back to the last checkpoint) and workers leaving, the end state has each sample once."""
    led = RangeLedger(n, size)
    model: Counter[int] = Counter()
    ckpt = (Counter(), led.checkpoint_state())
    current: dict[int, list[int]] = {}  # worker -> [range id, next sample, end]

    def consume(w: int, k: int) -> None:
        rid, nxt, end = current[w]
        upto = min(end, nxt + k)
        model.update(range(nxt, upto))
        led.report(rid, upto)
        current[w] = [rid, upto, end]
        if upto == end:
            del current[w]

    for op, w, k in ops:
        if op == "acquire" and w not in current:
            r = led.acquire(f"w{w}")
            if r is not None:
                current[w] = [r.id, r.start, r.end]
        elif op == "consume" and w in current:
            consume(w, k)
        elif op == "checkpoint":
            ckpt = (model.copy(), json.loads(json.dumps(led.checkpoint_state())))
        elif op == "crash":
            model, led, current = ckpt[0].copy(), RangeLedger.from_checkpoint(ckpt[1]), {}
        elif op == "leave" and w in current:
            led.release(f"w{w}")
            del current[w]
    for w in list(current):
        consume(w, n + 1)
    while (r := led.acquire("drain")) is not None:
        current[9] = [r.id, r.start, r.end]
        consume(9, n + 1)
    assert led.exhausted() and led.remaining_samples() == 0
    assert model == Counter(range(n)), "some sample is missing or counted twice"


def test_ledger_rejects_bad_reports_and_stores_json(tmp_path: Path) -> None:
    led = RangeLedger(10, 4)
    r = led.acquire("a")
    assert r is not None and (r.start, r.end) == (0, 4)
    with pytest.raises(LedgerError):
        led.report(1, 6)  # not leased
    led.report(r.id, 2)
    with pytest.raises(LedgerError):
        led.report(r.id, 1)  # backwards
    store = JsonFileLedgerStore(tmp_path / "ledger.json")
    assert store.load() is None
    store.save(led.checkpoint_state())
    again = RangeLedger.from_checkpoint(store.load() or {})
    first = again.acquire("b")
    assert first is not None and (first.id, first.start, first.end) == (0, 2, 4)  # resumes mid-range


# ---- data -----------------------------------------------------------------------------------------
def test_synthetic_data_is_deterministic_by_index_and_skewed(tmp_path: Path) -> None:
    d = SyntheticClickData(50_000, vocab_sizes=10_000, seed=7)
    b = d.batch(0, 20_000)
    assert b.dense.shape == (20_000, 13) and b.sparse.shape == (20_000, 26)
    idx = np.array([19_999, 3, 12_345])
    again = d.batch_indices(idx)
    assert torch.equal(again.sparse, b.sparse[idx]) and torch.equal(again.labels, b.labels[idx])
    assert not torch.equal(SyntheticClickData(50_000, 10_000, seed=8).batch(0, 100).sparse, b.sparse[:100])
    assert int(b.sparse.max()) < 10_000 and int(b.sparse.min()) >= 0
    assert zipf_head_share(b.sparse[:, 5].numpy(), 10_000, head=0.01) > 0.4  # 1% of ids: >40% of lookups
    assert 0.1 < float(b.labels.mean()) < 0.5
    kjt = b.kjt()
    assert len(kjt.keys()) == 26 and int(kjt.lengths().sum()) == 26 * 20_000


def test_criteo_tsv_round_trip(tmp_path: Path) -> None:
    d = SyntheticClickData(1000, vocab_sizes=5000, seed=1)
    path = tmp_path / "day_0.tsv"
    write_criteo_tsv(path, d, 100, 300)
    r = CriteoTSVReader(path, vocab_sizes=5000)
    assert len(r) == 200
    got, want = r.batch(20, 70), d.batch(120, 170)
    assert torch.equal(got.sparse, want.sparse) and torch.equal(got.dense, want.dense)
    assert torch.equal(got.labels, want.labels)
    with path.open("a") as f:
        f.write("1\t\t5" + "\t" * 37 + "\n")  # Criteo's empty fields
    last = CriteoTSVReader(path, vocab_sizes=5000).batch(200, 201)
    assert float(last.labels[0]) == 1.0 and int(last.sparse.sum()) == 0 and float(last.dense[0, 1]) > 0


def test_global_batches_take_each_sample_once_across_restores_and_epochs() -> None:
    from elastic_rm.train.ledger import GlobalBatches, LedgerError, RangeLedger

    def run(batches: GlobalBatches, steps: int) -> list[tuple[int, int, int]]:
        out = []
        for _ in range(steps):
            lo, hi = batches.next()
            batches.consumed()  # the ledger holds consumed batches only: its epoch is the batch's now
            out.append((batches.ledger.epoch, lo, hi))
        return out

    straight = run(GlobalBatches(RangeLedger(96, 24), 8), 30)  # 12 batches an epoch: 2.5 epochs
    assert [b[1] for b in straight[:12]] == list(range(0, 96, 8))
    assert straight[12] == (1, 0, 8) and straight[24] == (2, 0, 8)
    # restore from the ledger of any step: the rest is exactly what the straight run trained next
    for cut in (1, 3, 11, 12, 13, 17):
        first = GlobalBatches(RangeLedger(96, 24), 8)
        head = run(first, cut)
        resumed = GlobalBatches(RangeLedger.from_checkpoint(first.ledger.checkpoint_state()), 8)
        assert head + run(resumed, 30 - cut) == straight, cut
        assert resumed.ledger.samples_done() == 30 * 8
    with pytest.raises(ValueError, match="whole global batches"):
        GlobalBatches(RangeLedger(96, 20), 8)
    with pytest.raises(ValueError, match="whole global batches"):
        GlobalBatches(RangeLedger(100, 24), 8)
    # resumed with another global batch in the middle of a range: a clear error, not a skipped sample
    first = GlobalBatches(RangeLedger(96, 24), 8)
    run(first, 1)
    with pytest.raises(LedgerError, match="resume with the global batch it was saved with"):
        GlobalBatches(RangeLedger.from_checkpoint(first.ledger.checkpoint_state()), 12).next()


def test_global_batches_refuse_a_second_batch_before_the_first_is_consumed() -> None:
    """A pipeline that fetches ahead must not get the same batch twice without a sign."""
    from elastic_rm.train.ledger import GlobalBatches, LedgerError, RangeLedger

    batches = GlobalBatches(RangeLedger(96, 24), 8)
    with pytest.raises(LedgerError, match="consumed\\(\\) without a batch"):
        batches.consumed()
    assert batches.next() == (0, 8)
    with pytest.raises(LedgerError, match=r"next\(\) called again before consumed\(\): the batch \[0, 8\)"):
        batches.next()
    batches.consumed()
    with pytest.raises(LedgerError, match="consumed\\(\\) without a batch"):
        batches.consumed()
    assert batches.next() == (8, 16) and batches.ledger.samples_done() == 8
