"""Click-log data for examples, tests and benchmarks: a synthetic Criteo-like generator and a reader
for Criteo's TSV format, both addressed by sample index so that ledger ranges map to samples exactly.

Synthetic samples are a pure function of (seed, index): no state, any range in any order, on any rank.
Sparse ids follow a power law, P(id) ~ (id+1)^-s with a configurable exponent s (1 by default; 1.05-1.2
is the range reported for click logs, where a few percent of the rows take most lookups; 0 is uniform),
hot ids are the low ones. Dense features are heavy-tailed counts, and the label depends on a few
features so that a model can learn something.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

NUM_DENSE, NUM_SPARSE = 13, 26
_K = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def sparse_names(n: int = NUM_SPARSE) -> list[str]:
    return [f"cat_{i}" for i in range(n)]


@dataclass(frozen=True)
class ClickBatch:
    indices: torch.Tensor  # int64 [B]: sample indices
    dense: torch.Tensor  # float32 [B, 13]: log1p of the raw counts
    sparse: torch.Tensor  # int64 [B, 26]: one id per categorical feature
    labels: torch.Tensor  # float32 [B]

    def __len__(self) -> int:
        return int(self.indices.numel())

    def kjt(self, feature_names: Sequence[str] | None = None) -> Any:
        """The sparse features as a TorchRec KeyedJaggedTensor (one id per sample and feature)."""
        from torchrec import KeyedJaggedTensor

        names = list(feature_names or sparse_names(self.sparse.shape[1]))
        b = len(self)
        return KeyedJaggedTensor.from_lengths_sync(
            keys=names,
            values=self.sparse.t().contiguous().view(-1),
            lengths=torch.ones(len(names) * b, dtype=torch.int64),
        )


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer (wrapping uint64 arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * _K[1]
    x = (x ^ (x >> np.uint64(27))) * _K[2]
    return x ^ (x >> np.uint64(31))


def _uniform(seed: int, idx: np.ndarray, stream: np.ndarray) -> np.ndarray:
    """Uniform (0, 1) per (sample, stream), a pure function of (seed, sample index, stream). The seed is
    taken modulo 2**64, as torch's manual_seed takes it: a negative one (RandomRecDataset accepts
    ``manual_seed=-1``) overflowed uint64 at the first batch; seeds in [0, 2**64) are unchanged."""
    with np.errstate(over="ignore"):
        key = idx.astype(np.uint64)[:, None] * _K[0] + stream.astype(np.uint64)[None, :] * _K[1]
        key = _mix(key ^ _mix(np.full(1, int(seed) % (1 << 64), dtype=np.uint64) + _K[2]))
    return ((key >> np.uint64(11)).astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def power_law_ids(u: np.ndarray, vocab: np.ndarray, exponent: float) -> np.ndarray:
    """Ids in [0, vocab) from uniforms `u` in (0, 1) by inverting the continuous law (x+1)^-s on
    [0, vocab), floored: P(id = k) ~ (k+1)^-s in the tail, a closed form per draw (no table of the
    vocabulary, which can hold millions of rows). Written with expm1/log1p so that an exponent near 1
    stays exact; s = 1 is the log-uniform law, s = 0 the uniform one."""
    log_v = np.log(np.asarray(vocab, dtype=np.float64) + 1.0)
    if exponent == 1.0:
        ids = np.exp(u * log_v)
    else:
        a = 1.0 - exponent
        ids = np.exp(np.log1p(u * np.expm1(a * log_v)) / a)
    return np.minimum(np.floor(ids).astype(np.int64) - 1, np.asarray(vocab, dtype=np.int64) - 1)


def check_zipf_exponent(exponent: float) -> float:
    """The exponent as a float; a clear error for one the generator cannot use."""
    value = float(exponent)
    if not math.isfinite(value) or not 0.0 <= value <= 4.0:
        raise ValueError(
            f"zipf exponent {exponent!r}: use a number from 0 (uniform ids) to 4; click logs are "
            "about 1.05-1.2, and 1 is the default"
        )
    return value


class SyntheticClickData:
    """`num_samples` Criteo-like samples; `vocab_sizes` per sparse feature (an int for all);
    `zipf_exponent`: the power law of the sparse ids (module docstring)."""

    def __init__(
        self,
        num_samples: int,
        vocab_sizes: int | Sequence[int] = 100_000,
        seed: int = 0,
        num_dense: int = NUM_DENSE,
        num_sparse: int = NUM_SPARSE,
        zipf_exponent: float = 1.0,
    ) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.zipf_exponent = check_zipf_exponent(zipf_exponent)
        self.num_dense, self.num_sparse = num_dense, num_sparse
        sizes = [vocab_sizes] * num_sparse if isinstance(vocab_sizes, int) else list(vocab_sizes)
        if len(sizes) != num_sparse or min(sizes) < 1:
            raise ValueError(f"need {num_sparse} vocab sizes >= 1, got {sizes}")
        self.vocab_sizes = sizes
        self._vocab = np.asarray(sizes, dtype=np.int64)
        self._dense_scale = np.asarray([2.0 + 7.0 * i for i in range(num_dense)])

    def __len__(self) -> int:
        return self.num_samples

    def raw(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(raw dense counts int64 [B, D], sparse ids int64 [B, S], labels int64 [B])."""
        idx = np.asarray(indices, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.num_samples):
            raise IndexError(f"sample index outside [0, {self.num_samples})")
        nd, ns = self.num_dense, self.num_sparse
        u = _uniform(self.seed, idx, np.arange(nd + ns + 1))
        dense = np.floor(-np.log(u[:, :nd]) * self._dense_scale).astype(np.int64)
        sparse = power_law_ids(u[:, nd : nd + ns], self._vocab, self.zipf_exponent)
        z = -1.6 + 0.35 * np.log1p(dense[:, 0]) - 0.25 * np.log1p(dense[:, 1])
        z = z + 1.2 * (sparse[:, 0] % 7 == 0) + 0.8 * (sparse[:, 1] < 5)
        labels = (u[:, -1] < 1.0 / (1.0 + np.exp(-z))).astype(np.int64)
        return dense, sparse, labels

    def batch(self, start: int, end: int) -> ClickBatch:
        return self.batch_indices(np.arange(start, end, dtype=np.int64))

    def batch_indices(self, indices: np.ndarray) -> ClickBatch:
        dense, sparse, labels = self.raw(indices)
        return _to_batch(np.asarray(indices, dtype=np.int64), dense, sparse, labels)


def _to_batch(idx: np.ndarray, dense: np.ndarray, sparse: np.ndarray, labels: np.ndarray) -> ClickBatch:
    return ClickBatch(
        indices=torch.from_numpy(idx.copy()),
        dense=torch.from_numpy(np.log1p(np.maximum(dense, 0)).astype(np.float32)),
        sparse=torch.from_numpy(sparse.astype(np.int64)),
        labels=torch.from_numpy(labels.astype(np.float32)),
    )


def write_criteo_tsv(path: str | os.PathLike[str], data: SyntheticClickData, start: int, end: int) -> None:
    """Samples [start, end) in Criteo's format: label, 13 integer fields, 26 hex fields, tab-separated."""
    with open(path, "w") as f:
        for lo in range(start, end, 4096):
            dense, sparse, labels = data.raw(np.arange(lo, min(lo + 4096, end)))
            for d, s, y in zip(dense, sparse, labels, strict=True):
                f.write("\t".join([str(y), *map(str, d), *(f"{v:08x}" for v in s)]) + "\n")


class CriteoTSVReader:
    """Random access by sample index (line number) into a Criteo TSV file; empty fields read as 0.
    Categorical hex values are reduced modulo `vocab_sizes` (hashing into the tables)."""

    def __init__(self, path: str | os.PathLike[str], vocab_sizes: int | Sequence[int] = 100_000) -> None:
        self.path = Path(path)
        sizes = [vocab_sizes] * NUM_SPARSE if isinstance(vocab_sizes, int) else list(vocab_sizes)
        # checked as SyntheticClickData checks them: a size of 0 made every id 0 (a warning only), a
        # negative one gave negative ids (out of the table), a wrong count failed each batch
        if len(sizes) != NUM_SPARSE or min(sizes) < 1:
            raise ValueError(f"need {NUM_SPARSE} vocab sizes >= 1, got {sizes}")
        self.vocab_sizes = np.asarray(sizes, dtype=np.int64)
        offsets = [0]
        with open(self.path, "rb") as f:
            for line in f:
                offsets.append(offsets[-1] + len(line))
        self._offsets = np.asarray(offsets, dtype=np.int64)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    def batch(self, start: int, end: int) -> ClickBatch:
        if not 0 <= start <= end <= len(self):
            raise IndexError(f"range [{start}, {end}) outside the file's {len(self)} lines")
        n = end - start
        dense = np.zeros((n, NUM_DENSE), dtype=np.int64)
        sparse = np.zeros((n, NUM_SPARSE), dtype=np.int64)
        labels = np.zeros(n, dtype=np.int64)
        with open(self.path, "rb") as f:
            f.seek(int(self._offsets[start]))
            blob = f.read(int(self._offsets[end] - self._offsets[start])).decode()
        for i, line in enumerate(blob.splitlines()):
            fields = line.split("\t")
            if len(fields) != 1 + NUM_DENSE + NUM_SPARSE:
                raise ValueError(f"{self.path}:{start + i + 1}: {len(fields)} fields, Criteo has 40")
            labels[i] = int(fields[0] or 0)
            dense[i] = [int(x) if x else 0 for x in fields[1 : 1 + NUM_DENSE]]
            sparse[i] = [int(x, 16) if x else 0 for x in fields[1 + NUM_DENSE :]]
        sparse %= self.vocab_sizes
        return _to_batch(np.arange(start, end, dtype=np.int64), dense, sparse, labels)


def zipf_head_share(ids: np.ndarray, vocab: int, head: float = 0.01) -> float:
    """Share of ids in the top `head` fraction of the vocabulary (a skew check for tests and docs)."""
    return float(np.mean(ids < max(1, math.ceil(vocab * head))))
