"""Restore the newest good checkpoint into the current world: agree on a step, resolve every file
from the fastest source holding a verified copy, and fall back to older steps with a clear log line.

A delta step is restored from its chain: its links' manifests are found first, then the base is loaded
through DCP with the current plan while a thread reads and verifies the parts of the delta files this
rank applies (both wait on the network on a node that reads from peers), and once every rank has all of
them, each delta's rows that fall into this rank's shards are written over the base, in chain order. A
chain with a missing, corrupt or foreign step is refused as a whole, never mixed: the next older step is
then loaded over everything (and, once a chain was refused after its base loaded, the older chains' delta
files are read before their base: a refusal then costs no load). A rank reads (and a peer sends it) only
the header of each delta file and the entries that overlap its shards."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torchrec.distributed.model_parallel import DistributedModelParallel

from elastic_rm.checkpoint.chain import DeltaFiles, Wanted, apply_chain, chain_of, delta_files, overlaps_local
from elastic_rm.checkpoint.collectives import all_gather_json
from elastic_rm.checkpoint.manifest import CorruptCheckpointError
from elastic_rm.checkpoint.snapshot import app_state, load_app_state
from elastic_rm.checkpoint.sources import CheckpointSource, FileResolver, ResolvingReader, find_manifest

log = logging.getLogger(__name__)


@dataclass
class RestoreResult:
    step: int
    position: dict[str, Any]
    manifest: dict[str, Any]
    file_sources: dict[str, str]  # file -> source name it was read from, on this rank
    skipped: list[str] = field(default_factory=list)  # why newer checkpoints were not used
    load_s: float = 0.0  # the whole load on this rank
    verify_s: float = 0.0  # of which checksum verification of the base's files
    # on this rank, of a chain (0 for a full step): its delta files read and verified (the parts this
    # rank applies, on a thread of their own while the base loads), and of that the time the restore
    # waited for them after the base; the base (or the full step) loaded through DCP; the deltas' rows
    # applied over it, with the wait for every rank's outcome
    deltas_s: float = 0.0
    base_s: float = 0.0
    apply_s: float = 0.0
    deltas_wait_s: float = 0.0


class DeltaFetch:
    """A chain's delta files (chain.delta_files), read and verified on a thread of their own while the
    base loads (``on_thread``), through forks of the sources (``fork()``: a peer's connection is not
    shared between threads). Otherwise, or with a source that has no fork() (a custom one), they are
    read here, before the base, through the sources themselves."""

    def __init__(
        self,
        chain: list[dict[str, Any]],
        sources: Sequence[CheckpointSource],
        verify: bool,
        wanted: Wanted,
        on_thread: bool = True,
    ) -> None:
        self.took_s = 0.0
        self._files: DeltaFiles = []
        self._error: BaseException | None = None
        self._forks: list[tuple[Any, Any]] = []
        self._thread: threading.Thread | None = None
        if len(chain) < 2:
            return
        if not on_thread or not all(callable(getattr(src, "fork", None)) for src in sources):
            self._read(chain, sources, verify, wanted)
            return
        # a fork that is its source (a directory: nothing to share) is not cleared here
        self._forks = [(src, src.fork("deltas")) for src in sources]  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._read,
            args=(chain, [fork for _, fork in self._forks], verify, wanted),
            name="elastic-rm-restore-deltas",
            daemon=True,
        )
        self._thread.start()

    @property
    def on_thread(self) -> bool:
        return self._thread is not None

    def _read(
        self, chain: list[dict[str, Any]], sources: Sequence[Any], verify: bool, wanted: Wanted
    ) -> None:
        t0 = time.perf_counter()
        try:
            self._files = delta_files(chain, sources, verify, wanted)
        except BaseException as e:  # raised again by result(), on the restoring thread: whatever ended
            # the reads, a chain is never applied without all of its files
            self._error = e
        self.took_s = time.perf_counter() - t0

    def result(self) -> DeltaFiles:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._files

    def close(self) -> None:
        """Wait for the thread (its reads are bounded by the sources' timeouts) and drop what the forks
        downloaded: call on every way out of the step's restore, once its files are applied or not."""
        if self._thread is not None:
            self._thread.join()
        for src, fork in self._forks:
            clear = getattr(fork, "clear", None)
            if fork is not src and clear is not None:
                clear()
        self._forks = []


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, CorruptCheckpointError) else f"{type(e).__name__}: {e}"


def _short(e: BaseException, limit: int = 600) -> str:
    """One line per failing rank, without DCP's tracebacks."""
    if isinstance(e, CheckpointException):
        text = "; ".join(f"rank {r}: {type(x).__name__}: {x}" for r, (x, _) in sorted(e.failures.items()))
    else:
        text = f"{type(e).__name__}: {e}"
    return text if len(text) <= limit else text[:limit] + " ..."


def restore_checkpoint(
    dmp: DistributedModelParallel,
    dense_optimizer: torch.optim.Optimizer | None,
    sources: Sequence[CheckpointSource],
    pg: dist.ProcessGroup | None,
    rank: int,
    verify: bool = True,
    live: Callable[[dict[str, Any]], bool] | None = None,
) -> RestoreResult | None:
    """The newest step every rank finds the same sound manifest of (given `live`, one on the run's
    current timeline), loaded; None when no source holds a step. Collective."""
    mine = sorted({s for src in sources for s in src.steps()})
    steps = sorted({s for part in all_gather_json(mine, pg) for s in part}, reverse=True)
    skipped: list[str] = []
    overlap = True  # read a chain's delta files while its base loads (DeltaFetch)
    for step in steps:
        manifest, problems = find_manifest(step, sources, live)
        digests = all_gather_json(manifest["manifest_sha256"] if manifest else None, pg)
        if None in digests or len(set(digests)) != 1:
            why = "; ".join(problems) or "ranks found different manifests"
            reason = (
                f"step {step} skipped: {why}" if manifest is None else f"step {step} skipped on some rank"
            )
            skipped.append(reason)
            if rank == 0:
                log.warning("elastic-rm restore: %s; trying the previous checkpoint", reason)
            continue
        assert manifest is not None
        t0 = time.perf_counter()
        state = app_state(dmp, dense_optimizer)
        chain, fetch, why = [manifest], None, None
        try:
            try:  # a delta: its chain's manifests, then its delta files (while the base loads)
                chain = chain_of(manifest, sources)
                fetch = DeltaFetch(chain, sources, verify, overlaps_local(state), on_thread=overlap)
                if not fetch.on_thread:
                    fetch.result()  # read already: refused here, before the base loads
            except Exception as e:  # every rank must reach the gather below, whatever failed here
                why = _why(e)
            whys = [w for w in all_gather_json(why, pg) if w]
            if whys:
                reason = f"step {step} unusable: {whys[0]}"
                skipped.append(reason)
                if rank == 0:
                    log.warning("elastic-rm restore: %s; trying the previous checkpoint", reason)
                continue
            assert fetch is not None  # else this rank's own reason is among whys
            base = chain[0]
            resolver = FileResolver(base["step"], base, sources, verify)
            try:
                t1 = time.perf_counter()
                dcp.load(state, storage_reader=ResolvingReader(resolver), process_group=pg)
                t2 = time.perf_counter()
                deltas, why, t3 = [], None, t2
                try:
                    deltas = fetch.result()
                    t3 = time.perf_counter()
                    apply_chain(state, deltas)
                except Exception as e:  # every rank must reach the gather below, whatever failed here
                    why = _why(e)
                whys = [w for w in all_gather_json(why, pg) if w]
                if whys:
                    # a chain refused after its base loaded: the older steps' chains (which may share
                    # the refused delta) are read before their base, as a refusal then costs no load
                    overlap = False
                    raise CorruptCheckpointError(whys[0])
            except (Exception, CheckpointException) as e:  # DCP gathers all ranks' errors (a BaseException)
                reason = f"step {step} unusable: {_short(e)}"
                skipped.append(reason)
                if rank == 0:
                    log.warning("elastic-rm restore: %s; trying the previous checkpoint", reason)
                continue
            apply_s = time.perf_counter() - t3
        finally:  # whatever ends this step's try (a gather that raised included): the thread and the forks
            if fetch is not None:
                fetch.close()
        load_app_state(dmp, state, dense_optimizer)
        load_s = time.perf_counter() - t0
        used = {f: src for f, (src, _) in resolver.resolved.items()}
        for _, _, delta_used in deltas:
            used.update(delta_used)
        if rank == 0:
            log.info(
                "elastic-rm restore: step %d (saved at world %d%s) loaded into world %d in %.3fs",
                step,
                manifest["world_size"],
                f", a chain of step {base['step']} and {len(deltas)} deltas" if deltas else "",
                dist.get_world_size(pg),
                load_s,
            )
        return RestoreResult(
            step,
            manifest["position"],
            manifest,
            used,
            skipped,
            load_s,
            resolver.verify_s,
            fetch.took_s if deltas else 0.0,
            t2 - t1,
            apply_s if deltas else 0.0,
            t3 - t2 if deltas else 0.0,
        )
    if steps:
        raise CorruptCheckpointError(
            "no good checkpoint: " + " | ".join(skipped) + ". Restore a durable copy from backup or "
            "start fresh by removing the checkpoint directories."
        )
    return None
