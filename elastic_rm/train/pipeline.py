"""Elastic training for a TorchRec loop in a few lines, train pipelines included.

Why: a TorchRec script made elastic by hand needs a flash checkpointer, a restore, a sample ledger
saved with every checkpoint, the agent's drain, and rounds in place; and a pipeline that reads batches
ahead (``TrainPipelineSparseDist`` holds two in flight) must not count a fetched batch as trained.
:class:`ElasticTraining` is that setup in one object; :class:`LedgerIterator` is the iterator a
pipeline reads ahead from (it hands out the ledger's global batches with ``GlobalBatches.fetch``, and
:meth:`ElasticTraining.steps` marks one batch per step, oldest first); :func:`elastic_rounds` is
``rounds()`` with the backend of the device and the cleanup a body needs, and :func:`elastic_run` runs
a body inside each of its rounds. See docs/train.md, "Porting TorchRec's golden train_dlrm.py".

    elastic_run(train)                          # main(): the same process across rounds, losses included
    ...                                         # in train(), after the DMP and the pipeline:
    elastic = ElasticTraining(model, plan, dense_optimizer, global_batch=48)
    batches = elastic.batches(SyntheticClickData(10_000_000, vocab_sizes=num_embeddings))
    for _ in elastic.steps(num_iterations):
        pipeline.progress(batches)
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..checkpoint.flash import FlashCheckpointer, FlashConfig
from .ledger import GlobalBatches, RangeLedger
from .report import StepReporter, current_reporter, get_reporter
from .rounds import Round, rounds
from .sharding import dense_parameters
from .world_sizes import check_global_batch

T = TypeVar("T")


def default_backend() -> str:
    """nccl on a machine with CUDA, else gloo (what TorchRec's examples pick)."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def elastic_rounds(sync_every: int = 5, backend: str | None = None) -> Iterator[Round]:
    """:func:`elastic_rm.train.rounds.rounds` with this process's reporter and the device's backend.

    After each body it collects garbage (the body's DMP, pipeline and checkpointer hold the round's
    process groups), and after the last one it destroys the process group (gc first: gloo may abort at
    exit otherwise). The body must not initialise the process group itself: this does, each round."""
    done = False
    try:
        for rnd in rounds(get_reporter(sync_every=sync_every), backend or default_backend()):
            yield rnd
            gc.collect()
        done = True
    except GeneratorExit:  # the script left the loop with break: training is over
        done = True
        raise
    finally:
        if done and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()


def elastic_run(body: Callable[[], T], *, sync_every: int = 5, backend: str | None = None) -> T | None:
    """Run ``body()`` once per round, inside the round (``with rnd:``); what its last run returned.

    Why not ``for _ in elastic_rounds(): body()``: an exception in a for-loop's body never reaches the
    generator, so a collective that fails because a peer died ends the process (the agent restarts it).
    Here the round holds it: the process waits in place for the round without the lost peer and runs
    ``body()`` again there, restoring from node memory. A planned round (scale-up or down) drains
    ``body()`` at a step boundary and runs it again in the new world; a ``body()`` that returns without
    a drain ends the loop."""
    result: T | None = None
    for rnd in elastic_rounds(sync_every=sync_every, backend=backend):
        with rnd:
            result = body()
    return result


def torchrec_batch(click: Any, keys: list[str] | None = None) -> Any:
    """A ClickBatch (SyntheticClickData, CriteoTSVReader) as TorchRec's ``Batch``, which DLRMTrain and
    the train pipelines take."""
    from torchrec.datasets.utils import Batch

    return Batch(dense_features=click.dense, sparse_features=click.kjt(keys), labels=click.labels)


def _as_torchrec(batch: Any) -> Any:
    return torchrec_batch(batch) if hasattr(batch, "kjt") else batch


class LedgerIterator:
    """This rank's slice of the ledger's global batches, as an endless iterator a pipeline can read
    ahead from: each item is the next global batch after those in flight (``GlobalBatches.fetch``);
    nothing is marked trained here. Epochs follow one another (the ledger starts the next)."""

    def __init__(self, batches: GlobalBatches, make: Callable[[int, int], Any], rank: int, world: int):
        self.batches, self.make = batches, make
        self.local = batches.batch // world
        self.rank = rank

    def __iter__(self) -> LedgerIterator:
        return self

    def __next__(self) -> Any:
        lo, _hi = self.batches.fetch()
        start = lo + self.rank * self.local
        return self.make(start, start + self.local)


class _Steps:
    """The steps left to train, with a length for progress bars (tqdm)."""

    def __init__(self, owner: ElasticTraining, total: int) -> None:
        self.owner, self.total = owner, total

    def __len__(self) -> int:
        return max(0, self.total - self.owner.step)

    def __iter__(self) -> Iterator[int]:
        return self.owner._run(self.total)


class ElasticTraining:
    """Flash checkpoint, restore, sample ledger and drain for one round of a TorchRec training loop.

    Create it after the DMP and the dense optimizer (collective: it restores the newest good
    checkpoint into this world's plan). ``dense_optimizer`` is the script's own optimizer of the
    parameters without a fused optimizer; it must update only ``dense_parameters(dmp)`` (TorchRec's
    ``in_backward_optimizer_filter(model.named_parameters())`` is the same set when every table has a
    fused optimizer); anything else is refused here, since its state would not restore in another
    world. ``global_batch`` is fixed for the whole run: each rank trains ``global_batch / world``
    samples a step, so learning-rate semantics do not change with the world size. ``sync_every``: the
    step reporter's (None: the one ``elastic_run`` made, else 5)."""

    def __init__(
        self,
        dmp: Any,
        plan: Any,
        dense_optimizer: torch.optim.Optimizer | None,
        *,
        global_batch: int,
        checkpoint_every: int = 20,
        range_batches: int = 10,
        checkpoint_dir: str | Path | None = None,
        config: FlashConfig | None = None,
        sync_every: int | None = None,
    ) -> None:
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        check_global_batch(global_batch, self.world)  # every world --nnodes allows, from the first round
        if checkpoint_every <= 0 or range_batches <= 0:
            raise ValueError(
                f"checkpoint_every and range_batches must be > 0, got {checkpoint_every}, {range_batches}"
            )
        _check_dense_optimizer(dmp, dense_optimizer)
        self.reporter = _process_reporter(sync_every)  # before the restore: a refusal costs none
        self.global_batch, self.local_batch = global_batch, global_batch // self.world
        self.checkpoint_every, self.range_batches = checkpoint_every, range_batches
        if config is None:  # replicate: a lost node's shards are also in its ring peer's memory (ermrun)
            config = FlashConfig(durable_dir=Path(checkpoint_dir) if checkpoint_dir else None, replicate=True)
        self.ckpt = FlashCheckpointer(dmp, plan, dense_optimizer, config)
        self.restored = self.ckpt.restore()
        self.step = self.restored.step if self.restored else 0
        self._saved = self.step if self.restored else None
        self.ledger_batches: GlobalBatches | None = None
        if self.restored is not None:
            saved_batch = self.restored.position.get("global_batch", global_batch)
            if saved_batch != global_batch:
                # nothing of this instance trains: its checkpointer goes now, and its drain hook is never
                # registered (a later drain would have saved through it)
                self.ckpt.close()
                raise ValueError(
                    f"the checkpoint of step {self.step} was trained with global_batch {saved_batch}, this "
                    f"run asks for {global_batch}: resume with {saved_batch}, or start a new run (another "
                    "run id)"
                )
        self.reporter.on_stop(self._drained)
        self._say(
            f"restored step {self.step}" if self.restored else "fresh start (no checkpoint)",
        )

    # ---- data ----------------------------------------------------------------------------------
    def batches(
        self,
        data: Any,
        make: Callable[[int, int], Any] | None = None,
        num_samples: int | None = None,
    ) -> LedgerIterator:
        """The iterator to train from (a pipeline may read ahead). ``data`` is addressed by sample index:
        an ``IndexedRandomRecDataset``, a ``SyntheticClickData`` or ``CriteoTSVReader`` (their batches
        become TorchRec ``Batch``es), or anything with ``len()`` (or ``num_samples``) and a
        ``make(start, end)`` that builds the batch of those samples.

        A second call in the same round (a new pipeline after an evaluation, say) goes on from the
        batches trained so far; the previous iterator's read-ahead is handed out again. Why: it built
        the ledger again from the restored checkpoint (or fresh), so every batch trained since was
        trained twice and the checkpoints' ledger fell behind their step."""
        total = num_samples if num_samples is not None else len(data)
        make = make or (lambda start, end: _as_torchrec(data.batch(start, end)))
        range_size = self.range_batches * self.global_batch
        if self.ledger_batches is not None:  # the trained batches only, as a checkpoint of now has them
            ledger = RangeLedger.from_checkpoint(self.ledger_batches.ledger.checkpoint_state())
        elif self.restored is not None and "ledger" in self.restored.position:
            ledger = RangeLedger.from_checkpoint(self.restored.position["ledger"])
        else:
            if total < range_size:
                raise ValueError(f"{total} samples hold no whole range of {range_size}: use more data")
            ledger = RangeLedger(total // range_size * range_size, range_size)  # drop_last
        self.ledger_batches = GlobalBatches(ledger, self.global_batch)
        return LedgerIterator(self.ledger_batches, make, self.rank, self.world)

    # ---- the step loop -------------------------------------------------------------------------
    def steps(self, total: int) -> _Steps:
        """Iterate once per training step until global step ``total`` (from the restored step on).
        After each iteration's body (one optimizer step, e.g. one ``pipeline.progress()``), the oldest
        batch handed out is marked trained, a flash checkpoint is taken every ``checkpoint_every`` steps,
        and the agent's drain ends the loop (after the drain's checkpoint). At ``total``, the final
        checkpoint is committed."""
        if self.ledger_batches is None:
            raise RuntimeError("call batches(data) before steps(): the steps mark the ledger's batches")
        return _Steps(self, total)

    def position(self) -> dict[str, Any]:
        """What a checkpoint stores beside the state: the step, the ledger of trained samples, the batch."""
        assert self.ledger_batches is not None
        return {
            "step": self.step,
            "ledger": self.ledger_batches.ledger.checkpoint_state(),
            "global_batch": self.global_batch,
        }

    def _run(self, total: int) -> Iterator[int]:
        """The step loop. Reaching ``total`` does not free node memory: a script may call ``steps()``
        again (train, evaluate, train on), and a crash between two calls must find the last checkpoint.
        Under plain torchrun the script frees it at the job's end (``ckpt.close(finished=True)``)."""
        assert self.ledger_batches is not None
        try:
            self.reporter.reset_timer()
            while self.step < total:
                yield self.step
                # the body trained the oldest batch in flight (of the newest batches(): it may call it)
                self.ledger_batches.consumed()
                self.step += 1
                if self.checkpoint_every == 1 and self._saved == self.step - 1:
                    self._check_replicated(self.ckpt.wait())
                if self.step % self.checkpoint_every == 0:
                    self._save(block=False)
                if self.reporter.step(samples=self.local_batch):
                    self._say(f"drained at step {self.step}")
                    return  # the drain's checkpoint is taken (on_stop)
            if self._saved != self.step:
                self._save(block=True)
            self._say(
                f"reached step {self.step}; {self.ledger_batches.ledger.samples_done()} samples trained"
            )
        finally:
            self.ckpt.close()

    def _check_replicated(self, failed: list[str]) -> None:
        """With a checkpoint every step, a step counts as done only once the previous step's checkpoint
        is on every node and its ring peer: a failed push stops the round (the job resumes from its
        newest checkpoint) rather than letting a lost node cost more steps than that promises."""
        if failed:
            raise RuntimeError(
                f"step {self.step - 1}: replica push failed ({'; '.join(failed)}); with checkpoint_every=1 "
                "a step counts only once its checkpoint is replicated everywhere"
            )

    def _save(self, block: bool) -> None:
        self.ckpt.save(self.step, self.position(), block=block)
        self._saved = self.step

    def _drained(self, _steps: int) -> None:
        # every rank stops at the same step (sync_every), so the collective save is fine here
        if self._saved == self.step:
            self.ckpt.wait()  # this step's periodic checkpoint: committed once it is written
        else:
            self._save(block=True)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"elastic-rm: world {self.world}: {text}", file=sys.stderr, flush=True)


def _process_reporter(sync_every: int | None) -> StepReporter:
    """The process's step reporter. ``sync_every=None``: the one ``elastic_run``/``elastic_rounds`` made
    (with their ``sync_every``), else a new one with 5. Why: with a fixed default of 5 here, a script
    that passed ``sync_every`` to ``elastic_run`` only was refused by ``get_reporter`` ("already called
    with other arguments"), after its restore; an explicit value must still match the reporter's."""
    if sync_every is None:
        existing = current_reporter()
        return existing if existing is not None else get_reporter(sync_every=5)
    return get_reporter(sync_every=sync_every)


def _check_dense_optimizer(dmp: Any, opt: torch.optim.Optimizer | None) -> None:
    """The dense optimizer's state is saved by parameter name and restored in another world: a fused
    embedding shard or an empty placeholder of a table held by another rank has no such name."""
    if opt is None:
        return
    ok = {id(p) for _n, p in dense_parameters(dmp)}
    names = {id(p): n for n, p in dmp.named_parameters()}
    bad = [
        names.get(id(p), "<not a model parameter>")
        for g in opt.param_groups
        for p in g["params"]
        if id(p) not in ok
    ]
    if bad:
        raise ValueError(
            f"the dense optimizer updates {len(bad)} parameter(s) that are not dense, e.g. {bad[:3]}: fused "
            "embedding shards or empty placeholders of tables held by other ranks do not restore in "
            "another world. Build it over elastic_rm.train.dense_parameters(dmp) (or TorchRec's "
            "in_backward_optimizer_filter(dmp.named_parameters()) when every table has a fused optimizer)"
        )
