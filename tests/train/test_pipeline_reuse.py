"""ElasticTraining edge cases a training script hits."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_prefetch_batches import golden_parts, world_of_one  # noqa: F401  (a fixture)

import elastic_rm.train
from elastic_rm.checkpoint.node_memory import ENV_MEMORY_ROOT


@pytest.fixture
def node_memory_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """golden_parts' checkpointer on the default node-memory root (what a script under plain torchrun
    gets: FlashConfig.memory_root None), moved under tmp_path."""
    root = tmp_path / "shm"
    monkeypatch.setenv(ENV_MEMORY_ROOT, str(root))
    monkeypatch.delenv("ELASTIC_RM_AGENT_DIR", raising=False)  # no ermrun agent: the script frees it
    real = elastic_rm.train.FlashConfig

    def config(**kw):
        kw.pop("memory_root")
        return real(**kw)

    monkeypatch.setattr(elastic_rm.train, "FlashConfig", config)
    return root


def test_node_memory_stays_at_total_and_goes_with_close_finished_under_plain_torchrun(
    tmp_path: Path,
    world_of_one,  # noqa: ARG001, F811 - a fixture
    node_memory_root: Path,
) -> None:
    """docs/api.md: reaching `total` keeps this node's memory copies (the script may train on, and a
    crash in between must find the last checkpoint); `elastic.ckpt.close(finished=True)` at the job's end
    frees them under plain torchrun, the run's claim with them."""
    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=2)
    for _ in elastic.steps(3):
        pipeline.progress(it)
    node = node_memory_root / "prefetch" / "n0"
    assert sorted(p.name for p in node.glob("step-*"))[-1] == "step-00000003"  # kept at total
    for _ in elastic.steps(5):  # and training goes on from it
        pipeline.progress(it)
    assert elastic.step == 5 and sorted(p.name for p in node.glob("step-*"))[-1] == "step-00000005"
    elastic.ckpt.close(finished=True)
    assert not node.exists(), sorted(p.name for p in node.iterdir())
    assert not (node_memory_root / "prefetch").exists()  # the run directory and its claim too
    del pipeline, it, elastic


def test_sync_every_given_to_elastic_run_only_is_taken_by_elastic_training(
    tmp_path: Path,
    world_of_one,  # noqa: ARG001, F811 - a fixture
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`elastic_run(train, sync_every=10)` makes the process's reporter before train() runs;
    ElasticTraining's own default of 5 then made get_reporter refuse ("already called with other
    arguments"), after the restore. Without sync_every it takes the reporter there is; a value that
    contradicts it is still refused, now before the checkpointer is made."""
    from elastic_rm.train import report

    monkeypatch.setattr(report, "_REPORTER", None)  # this test's reporter only
    made = report.get_reporter(sync_every=10)  # what elastic_run(train, sync_every=10) does first
    elastic, pipeline, it = golden_parts(tmp_path, [])
    assert elastic.reporter is made and made.sync_every == 10
    del pipeline, it, elastic
    with pytest.raises(ValueError, match="already called with other arguments"):
        golden_parts(tmp_path, [], sync_every=5)
    monkeypatch.setattr(report, "_REPORTER", None)
    elastic, pipeline, it = golden_parts(tmp_path, [])  # no reporter yet: made with 5, as documented
    assert elastic.reporter.sync_every == 5
    del pipeline, it, elastic


def test_batches_called_again_goes_on_from_the_trained_batches(
    tmp_path: Path,
    world_of_one,  # noqa: ARG001, F811 - a fixture
) -> None:
    """A second `elastic.batches(...)` in the same round (a new TrainPipelineSparseDist after an
    evaluation, say) built the ledger again from the restored checkpoint, or fresh: samples 0-23 were
    trained twice and the step-6 checkpoint's ledger said 24 samples where 48 were in the model. Now it
    goes on from the batches trained; what the old pipeline had read ahead is handed out again. Also
    from inside the step loop."""
    import torch
    from torchrec.distributed import TrainPipelineSparseDist

    log: list[tuple[int, int]] = []
    elastic, pipeline, it = golden_parts(tmp_path, log, checkpoint_every=4)
    for _ in elastic.steps(3):
        pipeline.progress(it)
    assert log == [(i * 8, i * 8 + 8) for i in range(5)]  # 3 trained, 2 read ahead
    first = log[:3]

    def new_pipeline(elastic):
        return TrainPipelineSparseDist(elastic.ckpt.dmp, elastic.ckpt.dense_optimizer, torch.device("cpu"))

    log.clear()
    it = elastic.batches(None, make=it.make, num_samples=10_000_000)
    pipeline = new_pipeline(elastic)
    for step in elastic.steps(8):
        if step == 6:  # and once more inside the loop
            second = log[:3]
            log.clear()
            it = elastic.batches(None, make=it.make, num_samples=10_000_000)
            pipeline = new_pipeline(elastic)
        pipeline.progress(it)
    third = log[:2]
    trained = first + second + third
    assert trained == [(i * 8, i * 8 + 8) for i in range(8)], trained  # every sample once, in order
    assert elastic.position()["step"] == 8 and elastic.ledger_batches.ledger.samples_done() == 8 * 8
    del pipeline, it, elastic

    log.clear()
    elastic, pipeline, it = golden_parts(tmp_path, log, checkpoint_every=4)
    assert elastic.restored is not None and elastic.restored.step == 8
    for _ in elastic.steps(9):
        pipeline.progress(it)
    assert log[0] == (64, 72)  # the restore goes on after the 8 batches trained
    del pipeline, it, elastic


def test_a_refused_global_batch_registers_no_drain_hook(
    tmp_path: Path,
    world_of_one,  # noqa: ARG001, F811 - a fixture
) -> None:
    """A restore whose checkpoint was trained with another global batch is refused; the refused
    instance's drain hook was registered before the check, so a later drain saved through its
    checkpointer, which nothing closed."""
    elastic, pipeline, it = golden_parts(tmp_path, [], checkpoint_every=2)
    for _ in elastic.steps(2):
        pipeline.progress(it)
    reporter, hook = elastic.reporter, elastic.reporter._hook
    del pipeline, it, elastic
    with pytest.raises(ValueError, match="trained with global_batch 8, this run asks for 16"):
        golden_parts(tmp_path, [], global_batch=16)
    assert reporter._hook is hook
