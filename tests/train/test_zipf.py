"""The synthetic data's power-law ids (`zipf_exponent`): the law's shape, what it means for the rows a
run touches, and that every sample stays a pure function of its index (the ledger's ranges rely on it)."""

from __future__ import annotations

import numpy as np
import pytest

from elastic_rm.train.data import SyntheticClickData, _uniform, zipf_head_share
from elastic_rm.train.random_data import IndexedRandomRecDataset

VOCAB = 1_000_000


def _ids(exponent: float, n: int, vocab: int = VOCAB, seed: int = 3) -> np.ndarray:
    data = SyntheticClickData(n, vocab_sizes=vocab, seed=seed, num_sparse=2, zipf_exponent=exponent)
    return data.raw(np.arange(n))[1]


def test_exponent_one_is_the_default_law_unchanged() -> None:
    """The default keeps the log-uniform ids every existing run and checksum was made with."""
    idx = np.arange(20_000)
    data = SyntheticClickData(20_000, vocab_sizes=5000, seed=11)
    u = _uniform(11, idx, np.arange(13 + 26 + 1))[:, 13 : 13 + 26]
    old = np.minimum(np.floor(np.exp(u * np.log(5001.0))).astype(np.int64) - 1, 4999)
    assert np.array_equal(data.raw(idx)[1], old)
    assert np.array_equal(SyntheticClickData(20_000, 5000, seed=11, zipf_exponent=1.0).raw(idx)[1], old)


@pytest.mark.parametrize("exponent", [1.05, 1.1, 1.2])
def test_decades_of_ids_follow_the_exponent(exponent: float) -> None:
    """Under the density (id+1)^-s, the draws of id+1 in [100, 1000) over those in [1000, 10000) are
    10^(s-1)."""
    ids = _ids(exponent, 400_000).ravel()
    low = np.count_nonzero((ids >= 99) & (ids < 999))
    high = np.count_nonzero((ids >= 999) & (ids < 9999))
    assert low / high == pytest.approx(10 ** (exponent - 1), rel=0.03)
    assert ids.min() >= 0 and ids.max() < VOCAB


def test_top_percent_of_ids_takes_most_draws() -> None:
    shares = {s: zipf_head_share(_ids(s, 100_000).ravel(), VOCAB) for s in (0.0, 1.0, 1.1, 1.2)}
    assert shares[0.0] == pytest.approx(0.01, abs=0.002)  # uniform: the top 1% gets 1%
    assert 0.6 < shares[1.0] < shares[1.1] < shares[1.2]
    assert shares[1.1] > 0.75


def test_touched_fraction_is_far_below_uniform() -> None:
    """100 steps of 1024 samples: the rows a power law touches are a small part of what uniform ids
    touch, and the fewer the higher the exponent (what a differential checkpoint copies)."""
    steps, batch = 100, 1024
    touched = {}
    for s in (0.0, 1.05, 1.2):
        ids = _ids(s, steps * batch)[:, 0]
        touched[s] = np.unique(ids).size / VOCAB
    assert touched[0.0] == pytest.approx(1 - np.exp(-steps * batch / VOCAB), rel=0.02)
    assert touched[1.05] < touched[0.0] / 2.5
    assert touched[1.2] < touched[1.05] / 1.5


def test_samples_are_a_pure_function_of_their_index() -> None:
    data = SyntheticClickData(50_000, vocab_sizes=[10, 1000, VOCAB], seed=5, num_sparse=3, zipf_exponent=1.1)
    whole = data.batch(0, 50_000)
    order = np.random.default_rng(0).permutation(50_000)[:5000]
    picked = data.batch_indices(order)
    assert np.array_equal(picked.sparse.numpy(), whole.sparse.numpy()[order])
    assert np.array_equal(data.batch(1234, 1300).sparse.numpy(), whole.sparse.numpy()[1234:1300])
    again = SyntheticClickData(50_000, [10, 1000, VOCAB], seed=5, num_sparse=3, zipf_exponent=1.1)
    assert np.array_equal(again.batch(0, 50_000).labels.numpy(), whole.labels.numpy())
    assert whole.sparse[:, 0].max() < 10 and whole.sparse[:, 1].max() < 1000


def test_indexed_random_dataset_takes_the_exponent() -> None:
    keys = ["a", "b"]
    flat = IndexedRandomRecDataset(keys, batch_size=64, hash_size=VOCAB, ids_per_feature=1, zipf_exponent=0)
    skewed = IndexedRandomRecDataset(keys, 64, hash_size=VOCAB, ids_per_feature=1, zipf_exponent=1.2)
    ids_flat = flat.batch(0, 20_000).sparse_features.values().numpy()
    ids_skewed = skewed.batch(0, 20_000).sparse_features.values().numpy()
    assert zipf_head_share(ids_flat, VOCAB) < 0.05 < 0.8 < zipf_head_share(ids_skewed, VOCAB)
    part = skewed.batch(100, 164).sparse_features["b"].values()
    assert np.array_equal(part.numpy(), ids_skewed[20_000 + 100 : 20_000 + 164])  # feature-major values


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf"), 9.0])
def test_a_bad_exponent_says_what_to_use(bad: float) -> None:
    with pytest.raises(ValueError, match="zipf exponent .* from 0"):
        SyntheticClickData(10, 100, zipf_exponent=bad)
