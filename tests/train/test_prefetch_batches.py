"""The sample ledger under a pipeline that reads ahead: GlobalBatches.fetch and ElasticTraining with a
real TrainPipelineSparseDist (TorchRec DLRM, a gloo world of one in this process). Only batches whose
optimizer step ran reach the ledger, so a restore hands out again exactly those that were only fetched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from elastic_rm.train.ledger import GlobalBatches, LedgerError, RangeLedger


def straight(steps: int) -> list[tuple[int, int, int]]:
    """(epoch, start, end) of the batches a loop without read-ahead trains, in order."""
    b, out = GlobalBatches(RangeLedger(96, 24), 8), []
    for _ in range(steps):
        lo, hi = b.next()
        b.consumed()
        out.append((b.ledger.epoch, lo, hi))
    return out


@pytest.mark.parametrize("ahead", [1, 2, 3, 5])
@pytest.mark.parametrize("cut", [0, 1, 2, 10, 11, 12, 13, 23])
def test_read_ahead_then_restore_hands_out_exactly_the_batches_not_committed(ahead: int, cut: int) -> None:
    want = straight(30)  # 12 batches an epoch (ranges of 3): cuts at range and epoch boundaries
    b = GlobalBatches(RangeLedger(96, 24), 8)
    fetched = [b.fetch() for _ in range(ahead)]  # the pipeline fills up
    trained = []
    for _ in range(cut):  # a step trains the oldest batch in flight and fetches one more
        b.consumed()
        trained.append((b.ledger.epoch, *fetched[len(trained)]))
        fetched.append(b.fetch())
    assert trained == want[:cut] and fetched == [w[1:] for w in want[: cut + ahead]]
    assert b.in_flight == ahead and b.ledger.samples_done() == cut * 8
    state = b.ledger.checkpoint_state()  # the checkpoint of step `cut`, with `ahead` batches in flight
    resumed = GlobalBatches(RangeLedger.from_checkpoint(state), 8)
    again = [resumed.fetch() for _ in range(ahead)]
    assert again == fetched[cut:]  # exactly the batches that were fetched but not trained
    rest = []
    for _ in range(30 - cut):
        resumed.consumed()
        rest.append((resumed.ledger.epoch, *again[len(rest)]))
        again.append(resumed.fetch())
    assert trained + rest == want  # every sample once, in the same order as without read-ahead


def test_second_next_without_consumed_is_a_clear_error_and_fetch_is_the_way_ahead() -> None:
    b = GlobalBatches(RangeLedger(96, 24), 8)
    assert b.next() == (0, 8)
    with pytest.raises(LedgerError, match=r"next\(\) called again before consumed\(\).*fetch\(\)"):
        b.next()
    assert b.fetch() == (8, 16)  # reading ahead is explicit
    with pytest.raises(LedgerError, match=r"the batch \[0, 8\) is not in the model yet"):
        b.next()
    b.consumed()
    b.consumed()
    with pytest.raises(LedgerError, match="consumed\\(\\) without a batch"):
        b.consumed()
    assert b.next() == (16, 24) and b.ledger.samples_done() == 16
    with pytest.raises(ValueError, match="positive multiple"):
        GlobalBatches(RangeLedger(0, 24), 8)


# ---- with TorchRec's pipeline --------------------------------------------------------------------


@pytest.fixture
def world_of_one(tmp_path: Path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def golden_parts(tmp_path: Path, make_log: list[tuple[int, int]], **kw):
    """The golden script's model, optimizers and pipeline, small; ElasticTraining over a memory root in
    tmp_path. Returns (elastic, pipeline, iterator)."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
    from torchrec.distributed import TrainPipelineSparseDist
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.models.dlrm import DLRM, DLRMTrain
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.optim.keyed import KeyedOptimizerWrapper
    from torchrec.optim.optimizers import in_backward_optimizer_filter
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

    from elastic_rm.train import (
        ElasticTraining,
        FlashConfig,
        IndexedRandomRecDataset,
        WorldTopology,
        plan_sharding,
    )

    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=4, num_embeddings=50, feature_names=[f])
        for f in DEFAULT_CAT_NAMES
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(DLRM(ebc, 13, [8, 4], [8, 1], dense_device=torch.device("cpu")))
    apply_optimizer_in_backward(RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.1})
    sharder = EmbeddingBagCollectionSharder()
    plan = plan_sharding(model, WorldTopology.from_env(), sharders=[sharder])
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder], plan=plan)
    make_dense = kw.pop("dense", None)
    dense = (
        make_dense(dmp)
        if make_dense
        else KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(dmp.named_parameters())),
            lambda ps: torch.optim.Adagrad(ps, lr=0.1),
        )
    )
    pipeline = TrainPipelineSparseDist(dmp, dense, torch.device("cpu"))
    cfg = FlashConfig(
        run_id="prefetch", node_id="n0", memory_root=tmp_path / "mem", peers={}, **kw.pop("flash", {})
    )
    kw.setdefault("global_batch", 8)
    elastic = ElasticTraining(dmp, plan, dense, config=cfg, range_batches=3, **kw)
    data = IndexedRandomRecDataset(
        DEFAULT_CAT_NAMES, batch_size=8, hash_size=50, ids_per_feature=1, num_dense=13
    )

    def make(start: int, end: int):
        make_log.append((start, end))
        return data.batch(start, end)

    return elastic, pipeline, elastic.batches(data, make=make)


def test_pipeline_reads_ahead_and_a_restore_hands_out_the_batches_it_had_in_flight(
    tmp_path: Path,
    world_of_one,  # noqa: ARG001 - a fixture
) -> None:
    fetched: list[tuple[int, int]] = []
    elastic, pipeline, it = golden_parts(tmp_path, fetched, checkpoint_every=4)
    assert elastic.restored is None
    for _ in elastic.steps(7):
        pipeline.progress(it)
    # TrainPipelineSparseDist keeps two batches in flight: 9 fetched, 7 trained, checkpoint at step 7
    assert fetched == [(i * 8, i * 8 + 8) for i in range(9)]
    assert elastic.ledger_batches.in_flight == 2
    assert elastic.ledger_batches.ledger.samples_done() == 7 * 8
    del pipeline, it, elastic

    again: list[tuple[int, int]] = []
    elastic, pipeline, it = golden_parts(tmp_path, again, checkpoint_every=4)
    assert elastic.restored is not None and elastic.restored.step == 7
    assert elastic.restored.position["ledger"]["v"] == 1 and elastic.step == 7
    for _ in elastic.steps(10):
        pipeline.progress(it)
    # first the two batches that were only fetched, then on: nothing skipped, nothing trained twice
    assert again == [(i * 8, i * 8 + 8) for i in range(7, 12)]
    assert elastic.ledger_batches.ledger.samples_done() == 10 * 8
    del pipeline, it, elastic
    with pytest.raises(ValueError, match="trained with global_batch 8, this run asks for 16: resume with 8"):
        golden_parts(tmp_path, [], global_batch=16)


def test_indexed_random_rec_dataset_takes_random_rec_dataset_arguments() -> None:
    from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

    from elastic_rm.train import IndexedRandomRecDataset

    data = IndexedRandomRecDataset(
        DEFAULT_CAT_NAMES, batch_size=4, hash_size=30, ids_per_feature=1, num_dense=13
    )
    b = data.batch(10, 14)
    assert b.sparse_features.keys() == list(DEFAULT_CAT_NAMES) and tuple(b.dense_features.shape) == (4, 13)
    assert int(b.sparse_features.values().max()) < 30
    again = data.batch(12, 14)  # a pure function of the sample index
    assert torch.equal(again.dense_features, b.dense_features[2:])
    first = next(iter(data))
    assert torch.equal(first.labels, data.batch(0, 4).labels)
    with pytest.raises(ValueError, match="pass ids_per_feature=1"):
        IndexedRandomRecDataset(DEFAULT_CAT_NAMES, batch_size=4, hash_size=30)


def test_a_dense_optimizer_over_fused_shards_is_refused_with_what_to_do(
    tmp_path: Path,
    world_of_one,  # noqa: ARG001 - a fixture
) -> None:
    with pytest.raises(ValueError, match="dense_parameters\\(dmp\\)"):
        golden_parts(tmp_path, [], dense=lambda dmp: torch.optim.Adagrad(dmp.parameters(), lr=0.1))
