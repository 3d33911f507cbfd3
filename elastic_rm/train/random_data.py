"""TorchRec's RandomRecDataset, addressed by sample index: the same constructor, so a script that
trains on random batches keeps its dataset line, and each batch is a pure function of its samples, so
the sample ledger can hand out exactly the batches a checkpoint does not contain (RandomRecDataset's
batches come from one random stream and cannot be asked for by position)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from .data import SyntheticClickData

DEFAULT_NUM_SAMPLES = 10_000_000


class IndexedRandomRecDataset:
    """Random click batches with ``RandomRecDataset``'s arguments; ``batch(start, end)`` gives TorchRec's
    ``Batch`` of samples [start, end) (power-law ids below ``hash_size``, see SyntheticClickData;
    ``zipf_exponent`` sets the law's exponent, 0 for uniform ids). Iterating it yields ``batch_size``
    samples at a time from sample 0, as RandomRecDataset does; under ``ElasticTraining.batches`` the
    global batch of the job counts instead."""

    def __init__(
        self,
        keys: Sequence[str],
        batch_size: int,
        hash_size: int | None = 100,
        hash_sizes: Sequence[int] | None = None,
        ids_per_feature: int = 2,
        num_dense: int = 50,
        manual_seed: int | None = None,
        num_batches: int | None = None,
        zipf_exponent: float = 1.0,
    ) -> None:
        if ids_per_feature != 1:
            raise ValueError(
                f"ids_per_feature={ids_per_feature}: the indexed dataset has one id per feature and sample; "
                "pass ids_per_feature=1"
            )
        if batch_size <= 0:
            raise ValueError(f"batch_size must be > 0, got {batch_size}")
        sizes = list(hash_sizes) if hash_sizes is not None else hash_size
        if sizes is None:
            raise ValueError("pass hash_size or hash_sizes (the vocabulary of each key)")
        self.keys, self.batch_size = list(keys), batch_size
        num = num_batches * batch_size if num_batches is not None else DEFAULT_NUM_SAMPLES
        self.data = SyntheticClickData(
            num,
            sizes,
            seed=manual_seed or 0,
            num_dense=num_dense,
            num_sparse=len(self.keys),
            zipf_exponent=zipf_exponent,
        )

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, start: int, end: int) -> Any:
        from torchrec.datasets.utils import Batch

        click = self.data.batch(start, end)
        return Batch(dense_features=click.dense, sparse_features=click.kjt(self.keys), labels=click.labels)

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self) - self.batch_size + 1, self.batch_size):
            yield self.batch(start, start + self.batch_size)
