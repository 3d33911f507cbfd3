"""A DMP whose own module is the sharded collection (DistributedModelParallel(EmbeddingBagCollection(...)))
is tracked by row: its tables were keyed "_dmp_wrapped_module.embedding_bags.<t>.weight", a key its state
dict does not have, so every differential save copied the tables whole (SaveStats.tables_full) and saved
nothing over a full one."""

from __future__ import annotations

from pathlib import Path

from test_flash_chain_restarts import train_on
from test_flash_save_dirs import checkpointer, dmp  # noqa: F401  (a fixture)

from elastic_rm.checkpoint.delta_tracker import TouchedRows


def test_the_tables_of_a_collection_sharded_as_the_dmp_module_are_its_state_keys(dmp) -> None:  # noqa: F811
    model = dmp[0]
    tracker = TouchedRows(model)
    try:
        assert tracker.tables == {"embedding_bags.t0.weight": 20}
        assert set(tracker.tables) <= set(model.state_dict())
    finally:
        tracker.detach()


def test_a_delta_of_such_a_dmp_copies_the_rows_touched(dmp, tmp_path: Path) -> None:  # noqa: F811
    model = dmp[0]
    ck = checkpointer(dmp, tmp_path / "mem", differential=True)
    try:
        ck.save(1, block=True)
        train_on(model, [3, 7, 7])
        stats = ck.save(2, block=True)
        assert (stats.kind, stats.tables_full, stats.rows_touched, stats.rows_total) == ("delta", [], 2, 20)
    finally:
        ck.close()
