"""Exactly-once dynamic data sharding (DLRover-RM's dynamic data sharding).

The dataset [0, num_samples) is cut into index ranges handed out on demand, so faster workers take more.
The ledger is pure state: a leader owns it, workers acquire ranges and report progress, and the leader
puts `checkpoint_state()` into the checkpoint's manifest (FlashCheckpointer.save(position=...)). The
done marks therefore commit atomically with the model state that contains their effect. After a
failure, `RangeLedger.from_checkpoint(state)` hands out again everything not done as of that
checkpoint, a partly consumed range from the first sample not in the checkpoint. Nothing here does I/O;
`LedgerStore` is the small protocol for keeping the state elsewhere too (a JSON file here; etcd later).
"""

from __future__ import annotations

import itertools
import json
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class DataRange:
    """Samples [start, end) of range `id`; `start` is past the range's first sample when it resumes a
    range that was partly consumed before the checkpoint."""

    id: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


class LedgerError(RuntimeError):
    pass


MAX_RANGES = 100_000_000  # a checkpointed ledger with more ranges is malformed (and would not fit)


class RangeLedger:
    def __init__(self, num_samples: int, range_size: int, epoch: int = 0) -> None:
        if num_samples < 0 or range_size <= 0:
            raise ValueError(f"need num_samples >= 0 and range_size > 0, got {num_samples}, {range_size}")
        self.num_samples = num_samples
        self.range_size = range_size
        self.epoch = epoch
        self.num_ranges = -(-num_samples // range_size)
        self.done: set[int] = set()
        self.progress: dict[int, int] = {}  # range id -> first sample not yet consumed (partial ranges)
        self.leases: dict[int, str] = {}  # range id -> worker
        self._todo: list[int] = list(range(self.num_ranges))

    def bounds(self, range_id: int) -> tuple[int, int]:
        lo = range_id * self.range_size
        return lo, min(lo + self.range_size, self.num_samples)

    def acquire(self, worker: str) -> DataRange | None:
        """The lowest range nobody holds, leased to `worker`; None when all are handed out."""
        if not self._todo:
            return None
        rid = self._todo.pop(0)
        self.leases[rid] = worker
        lo, hi = self.bounds(rid)
        return DataRange(rid, self.progress.get(rid, lo), hi)

    def report(self, range_id: int, consumed_upto: int) -> None:
        """The samples of the range below `consumed_upto` are in the model now (after the step)."""
        if range_id not in self.leases:
            raise LedgerError(
                f"range {range_id} is not leased (done: {range_id in self.done}); report only "
                "ranges this ledger handed out"
            )
        lo, hi = self.bounds(range_id)
        if not self.progress.get(range_id, lo) <= consumed_upto <= hi:
            raise LedgerError(f"range {range_id}: progress {consumed_upto} outside [{lo}, {hi}] or backwards")
        if consumed_upto == hi:
            self.done.add(range_id)
            self.progress.pop(range_id, None)
            del self.leases[range_id]
        else:
            self.progress[range_id] = consumed_upto

    def release(self, worker: str) -> list[int]:
        """A worker left without finishing: its ranges go back (from their progress), lowest first."""
        back = sorted(r for r, w in self.leases.items() if w == worker)
        for r in back:
            del self.leases[r]
        self._todo = sorted(self._todo + back)
        return back

    def exhausted(self) -> bool:
        return len(self.done) == self.num_ranges

    def remaining_samples(self) -> int:
        total = 0
        for r in range(self.num_ranges):
            if r not in self.done:
                lo, hi = self.bounds(r)
                total += hi - self.progress.get(r, lo)
        return total

    def samples_done(self) -> int:
        """Samples in the model over all epochs: every earlier epoch whole, plus this one's done part."""
        return self.epoch * self.num_samples + self.num_samples - self.remaining_samples()

    def checkpoint_state(self) -> dict[str, Any]:
        """JSON state to store in the checkpoint manifest: what the model state contains. Leases are
        not part of it: after a restore, everything not done is handed out again."""
        return {
            "v": 1,
            "num_samples": self.num_samples,
            "range_size": self.range_size,
            "epoch": self.epoch,
            "done": _compress(sorted(self.done)),
            "progress": {str(k): v for k, v in sorted(self.progress.items())},
        }

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> RangeLedger:
        if not isinstance(state, dict) or state.get("v") != 1:
            got = state.get("v") if isinstance(state, dict) else type(state).__name__
            raise LedgerError(f"unknown ledger state version {got!r}; expected 1")
        # Validated before use: a hostile state must be a LedgerError, never a crash, and never a hang
        # expanding a run such as [0, 10**18] (found by tests/chaos/test_hostile_input.py).
        try:
            num, size, epoch = (state["num_samples"], state["range_size"], state.get("epoch", 0))
            runs, progress = state["done"], state.get("progress", {})
            ints = [num, size, epoch, *(x for run in runs for x in run)]
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in ints) or not isinstance(
                progress, dict
            ):
                raise TypeError("fields must be integers")
            if size > 0 and -(-num // size) > MAX_RANGES:
                raise ValueError(f"{num} samples in ranges of {size} exceed {MAX_RANGES} ranges")
            led = cls(num, size, epoch)
            if any(len(run) != 2 or not 0 <= run[0] <= run[1] < led.num_ranges for run in runs):
                raise ValueError(f"'done' runs must be [first, last] within [0, {led.num_ranges})")
            led.progress = {int(k): int(v) for k, v in progress.items()}
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise LedgerError(f"malformed ledger state: {type(exc).__name__}: {exc}") from None
        led.done = set(_expand(runs))
        led._todo = [r for r in range(led.num_ranges) if r not in led.done]
        return led


class GlobalBatches:
    """The global batches of a synchronous job, drawn range by range from a RangeLedger.

    In synchronous data-parallel training the world steps together, so the world as a whole takes one
    range at a time and cuts one global batch per step from it; every rank holds the same ledger and
    advances it identically (no collective per range), and rank 0's state goes into the checkpoint.
    `ledger` is the current epoch's RangeLedger (replaced at each epoch): checkpoint its state.
    An exhausted ledger starts the next epoch. Ranges must hold whole global batches: a dataset whose
    size is not a multiple of the range size drops its tail (`drop_last`).

    Two ways to take batches: `next()` for a loop that trains each batch before it takes the next, and
    `fetch()` for a pipeline that reads ahead (TorchRec's TrainPipelineSparseDist holds two batches in
    flight). Either way `consumed()` marks the oldest batch handed out and not yet marked; only marked
    batches are in `ledger`, so a checkpoint never counts a batch that was only fetched.
    """

    OWNER = "world"

    def __init__(self, ledger: RangeLedger, batch: int) -> None:
        if (
            batch <= 0
            or ledger.num_samples <= 0
            or ledger.range_size % batch
            or ledger.num_samples % ledger.range_size
        ):
            raise ValueError(
                f"ranges of {ledger.range_size} samples over {ledger.num_samples} must hold whole global "
                f"batches of {batch}: make the range size a multiple of the batch and the sample count a "
                "positive multiple of the range size"
            )
        self.ledger, self.batch = ledger, batch
        self._range: DataRange | None = None  # the range the last consumed batch came from
        self._cursor = 0  # first sample of _range not consumed
        self._ahead: deque[tuple[int, int]] = deque()  # handed out, not consumed yet; oldest first

    @property
    def in_flight(self) -> int:
        """Batches handed out and not consumed yet."""
        return len(self._ahead)

    def next(self) -> tuple[int, int]:
        """[start, end) of this step's global batch (the same on every rank); call `consumed` after it.

        A second call before `consumed` is an error, not the same batch again: a data pipeline that
        fetches ahead would otherwise train one batch twice without a sign. Such a pipeline uses `fetch`."""
        if self._ahead:
            lo, hi = self._ahead[0]
            raise LedgerError(
                f"next() called again before consumed(): the batch [{lo}, {hi}) is not in the model yet. "
                "Call consumed() after each optimizer step; a pipeline that fetches batches ahead "
                "(TrainPipelineSparseDist) must take them with fetch() (or elastic_rm.train.pipeline's "
                "LedgerIterator), which hands out the batches after those in flight"
            )
        return self.fetch()

    def fetch(self) -> tuple[int, int]:
        """[start, end) of the global batch after every batch in flight (read-ahead). Nothing is marked:
        `consumed` marks the batches in the order they were fetched, one per optimizer step."""
        batch = next(itertools.islice(self._upcoming(), len(self._ahead), None))
        self._ahead.append(batch)
        return batch

    def consumed(self) -> None:
        """The oldest batch handed out is in the model now (after the optimizer step)."""
        if not self._ahead:
            raise LedgerError("consumed() without a batch from next() or fetch(): nothing to mark done")
        lo, hi = self._ahead.popleft()
        if self._range is None or self._cursor >= self._range.end:
            r = self.ledger.acquire(self.OWNER)
            if r is None:  # every range is done: the next epoch
                led = self.ledger
                self.ledger = RangeLedger(led.num_samples, led.range_size, led.epoch + 1)
                r = self.ledger.acquire(self.OWNER)
            assert r is not None  # a fresh ledger of a non-empty dataset has ranges
            self._range, self._cursor = r, r.start
        if (lo, hi) != (self._cursor, self._cursor + self.batch):
            raise LedgerError(
                f"the batch [{lo}, {hi}) was handed out but the ledger is at [{self._cursor}, "
                f"{self._cursor + self.batch}): its ledger changed while batches were in flight"
            )
        self._cursor = hi
        self.ledger.report(self._range.id, hi)

    def _upcoming(self) -> Iterator[tuple[int, int]]:
        """The batches not consumed yet, in the order `consumed` will mark them (changes nothing)."""
        led = self.ledger
        if self._range is not None and self._cursor < self._range.end:
            yield from self._cut(led, self._range.id, self._cursor)
        for rid in led._todo:  # acquire() hands out the lowest free range first
            yield from self._cut(led, rid, led.progress.get(rid, led.bounds(rid)[0]))
        while True:  # the following epochs: fresh ledgers, every range whole
            for rid in range(led.num_ranges):
                yield from self._cut(led, rid, led.bounds(rid)[0])

    def _cut(self, led: RangeLedger, rid: int, start: int) -> Iterator[tuple[int, int]]:
        lo, hi = led.bounds(rid)
        if (start - lo) % self.batch:
            raise LedgerError(
                f"range {rid} was partly consumed up to sample {start}, not a whole number of global "
                f"batches of {self.batch} from its start {lo}: resume with the global batch it was "
                "saved with"
            )
        for s in range(start, hi, self.batch):
            yield s, s + self.batch


def _compress(ids: list[int]) -> list[list[int]]:
    """Sorted ids as [first, last] runs, so a long run's state stays small."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return runs


def _expand(runs: list[list[int]]) -> list[int]:
    return [i for a, b in runs for i in range(a, b + 1)]


class LedgerStore(Protocol):
    """Where the leader keeps the latest ledger state between checkpoints (optional; the checkpoint
    manifest is the source of truth for what is done)."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any]) -> None: ...


class JsonFileLedgerStore:
    """A JSON file replaced atomically (write, fsync, rename)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None

    def save(self, state: dict[str, Any]) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
