"""Which embedding rows a model touched since the last checkpoint, as global row ids per table.

A fused optimizer (TorchRec's optimizer in the backward pass) updates only the rows a batch looked up,
so the rows looked up since a save are every row whose weight or optimizer state can have changed.
The ids are recorded where each sharded embedding module receives its batch (``input_dist``: the
global ids, before the all-to-all) and counted as touched once that module computes the batch
(``compute_and_output_dist`` or ``compute``, in the same order): a pipeline that starts the input
distribution of the next batches before the current step ends keeps those batches pending, so a
save between the two neither misses them nor counts them early. A rank's shards are looked up by
every rank's batch, so a save unites the ids of all ranks (one all-gather).

TorchRec's ``ModelDeltaTrackerTrec`` is not used: it records the ids after the all-to-all, which are
local to each shard in a way that depends on the sharding type (a row-wise shard's ids start at its own
block), and it is wired in when the DMP is built (``model_tracker_configs``). A checkpoint that must
restore into another plan needs global row ids, and the checkpointer is created after the DMP; the ids
before the input distribution are global for every sharding type.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

_MERGE_EVERY = 64  # record calls between merges of a table's pending ids into one unique tensor
_MIN_CAPACITY = 1 << 12  # ids per rank a take's gather holds in its first round, at least
# and at most: one unusually large take must not make every later take send (and every rank receive,
# world times over) a buffer of its size; a take larger than this uses the second round
MAX_CAPACITY = 1 << 20


def sorted_unique(ids: torch.Tensor) -> torch.Tensor:
    """The distinct values of `ids`, sorted. On the CPU through numpy, whose integer sort is many times
    faster than torch's (a save at every step takes the union of every table's ids twice)."""
    if ids.device.type != "cpu":
        return torch.unique(ids)
    s = np.sort(ids.numpy())
    if s.size > 1:
        s = s[np.concatenate(([True], s[1:] != s[:-1]))]
    return torch.from_numpy(s)


def _table_configs(module: nn.Module) -> tuple[str, list[Any]] | None:
    """(state-dict attribute, table configs) of a sharded embedding collection, else None."""
    for attr, configs in (("embedding_bags", "_embedding_bag_configs"), ("embeddings", "_embedding_configs")):
        tables = getattr(module, configs, None)
        if isinstance(tables, list) and tables and callable(getattr(module, "input_dist", None)):
            return attr, tables
    return None


def _state_prefix(name: str) -> str:
    """The state-dict prefix (with its dot; "" at the root) of the DMP's module `name`: the DMP's and a
    DDP's wrappers are not in the keys. A collection sharded as the DMP's own module is named
    "_dmp_wrapped_module", whose tables are keyed "embedding_bags.<table>.weight"."""
    for wrapper in ("_dmp_wrapped_module", "module"):
        name = "" if name == wrapper else name.removeprefix(wrapper + ".")
    return f"{name}." if name else ""


class TouchedRows:
    """Records the rows a DMP's sharded tables look up. Keys of `tables` are the tables' weight keys in
    the DMP's state dict; values are their row counts."""

    def __init__(self, dmp: nn.Module) -> None:
        self.tables: dict[str, int] = {}
        self._feature_table: dict[str, str] = {}
        self._pending: list[list[tuple[str, torch.Tensor]]] = []  # per batch handed to input_dist
        self._touched: dict[str, list[torch.Tensor]] = {}
        self._calls = 0
        self._capacity = _MIN_CAPACITY  # see _gather
        # (module, method name, our wrapper, what the instance held before: None for the class's own)
        self._wrapped: list[tuple[nn.Module, str, Any, Any]] = []
        self.attached = True
        for name, module in dmp.named_modules():
            found = _table_configs(module)
            if found is None or "Sharded" not in type(module).__name__:
                continue
            prefix = _state_prefix(name)
            attr, configs = found
            for cfg in configs:
                key = f"{prefix}{attr}.{cfg.name}.weight"
                self.tables[key] = int(cfg.num_embeddings)
                for feature in cfg.feature_names:
                    self._feature_table[feature] = key
            self._wrap(module)

    def _wrap(self, module: nn.Module) -> None:
        dist_input = module.input_dist
        busy = {"on": False}

        @functools.wraps(dist_input)
        def input_dist(ctx: Any, features: Any, *args: Any, **kwargs: Any) -> Any:
            self._record(features)
            return dist_input(ctx, features, *args, **kwargs)

        before = module.__dict__.get("input_dist")
        module.input_dist = input_dist  # type: ignore[method-assign]
        self._wrapped.append((module, "input_dist", input_dist, before))
        for name in ("compute_and_output_dist", "compute"):
            inner = getattr(module, name, None)
            if inner is None:
                continue

            def computed(*args: Any, _inner: Any = inner, **kwargs: Any) -> Any:
                outer = not busy["on"]
                if outer:  # one batch counts once, whichever of the two the caller used
                    busy["on"] = True
                    self._consume()
                try:
                    return _inner(*args, **kwargs)
                finally:
                    if outer:
                        busy["on"] = False

            before = module.__dict__.get(name)
            setattr(module, name, computed)
            self._wrapped.append((module, name, computed, before))

    def detach(self) -> None:
        """Stop recording and give the modules the methods they had before (a later tracker on the same
        model may have wrapped ours: then ours stays in its chain, recording nothing)."""
        self.attached = False
        for module, name, wrapper, before in reversed(self._wrapped):
            if module.__dict__.get(name) is wrapper:
                if before is None:
                    del module.__dict__[name]
                else:
                    setattr(module, name, before)
        self._wrapped, self._pending, self._touched = [], [], {}

    def _record(self, features: Any) -> None:
        if not self.attached:
            return
        batch = []
        for feature in features.keys():
            key = self._feature_table.get(feature)
            if key is not None:
                # a copy on the batch's device: no host sync in the step; take() moves the union to the CPU
                batch.append((key, features[feature].values().detach().clone()))
        self._pending.append(batch)

    def _consume(self) -> None:
        if not self._pending or not self.attached:
            return
        for key, ids in self._pending.pop(0):
            self._touched.setdefault(key, []).append(ids)
        self._calls += 1
        if self._calls % _MERGE_EVERY == 0:
            for key, parts in self._touched.items():
                self._touched[key] = [sorted_unique(torch.cat(parts))]

    def take(self, pg: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
        """The sorted global row ids each table looked up on any rank since the last take (collective),
        and forget them. Batches handed out but not computed yet count too and stay pending (counted
        again once computed): a batch whose input went out but was never computed (a pipeline dropped
        mid-stream, an exception between the two) can then shift which batch a compute consumes, yet
        every id handed out is in this delta or in the next, never in none."""
        keys = sorted(self.tables)
        if not keys:  # the same model on every rank: all return here
            return {}
        parts_of = {k: list(self._touched.get(k, ())) for k in keys}
        for batch in self._pending:
            for key, ids in batch:
                parts_of[key].append(ids)
        mine = [
            sorted_unique(torch.cat(parts_of[k])).to("cpu", torch.int64)
            if parts_of[k]
            else torch.empty(0, dtype=torch.int64)
            for k in keys
        ]
        self._touched = {}
        per_table: dict[str, list[torch.Tensor]] = {k: [] for k in keys}
        for counts, ids in self._gather(mine, pg):
            for k, part in zip(keys, torch.split(ids, counts.tolist()), strict=True):
                per_table[k].append(part)
        return {k: sorted_unique(torch.cat(parts)) for k, parts in per_table.items()}

    def _gather(
        self, mine: list[torch.Tensor], pg: dist.ProcessGroup | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every rank's (ids per table, their concatenation). One round in the usual case: each rank
        sends its counts and ids in a buffer of the capacity every rank derived from the previous
        take; a second round, sized by the longest, when a rank's ids do not fit."""
        k, world = len(mine), dist.get_world_size(pg)
        counts = torch.tensor([len(m) for m in mine], dtype=torch.int64)
        n = int(counts.sum())
        joined = torch.cat(mine) if mine else torch.empty(0, dtype=torch.int64)
        buf = torch.zeros(1 + k + self._capacity, dtype=torch.int64)
        buf[0] = n
        buf[1 : 1 + k] = counts
        if n <= self._capacity:
            buf[1 + k : 1 + k + n] = joined
        out = [torch.empty_like(buf) for _ in range(world)]
        dist.all_gather(out, buf, group=pg)
        sizes = [int(o[0]) for o in out]
        longest = max(sizes)
        if longest <= self._capacity:
            ids = [o[1 + k : 1 + k + m] for o, m in zip(out, sizes, strict=True)]
        else:
            flat = torch.zeros(longest, dtype=torch.int64)
            flat[:n] = joined
            full = [torch.empty_like(flat) for _ in range(world)]
            dist.all_gather(full, flat, group=pg)
            ids = [g[:m] for g, m in zip(full, sizes, strict=True)]
        # the same on every rank (from the same gathered sizes): room for twice the longest next time
        self._capacity = min(MAX_CAPACITY, max(_MIN_CAPACITY, 1 << (2 * longest).bit_length()))
        return [(o[1 : 1 + k], part) for o, part in zip(out, ids, strict=True)]

    @property
    def capacity(self) -> int:
        """Ids per rank the next take's first gather round holds."""
        return self._capacity

    def forget(self) -> None:
        """Drop what was computed so far (a full save copies everything anyway)."""
        self._touched = {}
