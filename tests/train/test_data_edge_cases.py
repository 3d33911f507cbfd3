"""Data sources addressed by sample index: edge cases."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_rm.train.data import CriteoTSVReader, SyntheticClickData, write_criteo_tsv
from elastic_rm.train.random_data import IndexedRandomRecDataset


def test_a_negative_seed_works_as_random_rec_dataset_takes_it() -> None:
    """RandomRecDataset (whose arguments IndexedRandomRecDataset takes) accepts manual_seed=-1, as
    torch's generators do; the indexed twin raised OverflowError at its first batch, inside the
    pipeline's read-ahead. The seed is taken modulo 2**64: -1 is 2**64 - 1, other seeds unchanged."""
    keys = [f"cat_{i}" for i in range(3)]
    data = IndexedRandomRecDataset(keys, batch_size=4, hash_size=30, ids_per_feature=1, manual_seed=-1)
    batch = data.batch(0, 4)
    assert tuple(batch.dense_features.shape) == (4, 50)
    same = SyntheticClickData(8, 30, seed=(1 << 64) - 1, num_dense=50, num_sparse=3).batch(0, 4)
    assert torch.equal(batch.dense_features, same.dense)
    dense, sparse, _labels = SyntheticClickData(8, 30, seed=7, num_sparse=3).raw(np.arange(4))
    # a seed in [0, 2**64) gives the samples it always gave (values taken before the change)
    assert sparse.tolist() == [[9, 1, 5], [16, 2, 15], [2, 26, 10], [5, 1, 4]]
    assert dense[:, 0].tolist() == [3, 3, 7, 2]


@pytest.mark.parametrize("sizes", [0, -5, [1000] * 25])
def test_criteo_reader_refuses_vocab_sizes_that_cannot_hash_ids(tmp_path, sizes) -> None:
    """CriteoTSVReader reduced the hex ids modulo vocab_sizes unchecked: 0 made every id 0 (a numpy
    warning only), -5 gave negative ids (outside every table), 25 sizes failed each batch with a numpy
    broadcast error. Refused when made now, as SyntheticClickData refuses them."""
    path = tmp_path / "day.tsv"
    write_criteo_tsv(path, SyntheticClickData(8, 1000), 0, 8)
    with pytest.raises(ValueError, match="need 26 vocab sizes >= 1"):
        CriteoTSVReader(path, vocab_sizes=sizes)
    assert CriteoTSVReader(path, vocab_sizes=1000).batch(0, 8).sparse.max() < 1000
