"""Flash checkpoint: pause the step loop only for an in-memory snapshot, write it with DCP into this
node's shared-memory directory in the background, optionally replicate it into one peer node's memory
(pushed to that node's agent over HTTP) and persist it to a durable directory; restore it into any world
size with a new plan, reading each file from this node's memory, a peer's memory over HTTP, or durable.

With FlashConfig.differential a save after the first copies only the table rows looked up since the
previous save (plus the dense state): a chain of delta steps on a full base (elastic_rm/checkpoint/chain.py).
A chain about to pass its bound is folded into its base in place, in the background
(elastic_rm/checkpoint/inplace.py, fold.py).

Every collective of the background work runs on a private gloo group, so training collectives on the
default group can proceed meanwhile. Manifests and the training position are JSON.

Size: one save's life (snapshot, the decision to fold and the fold's gathers across ranks and peer,
memory commit, replica push, gathered result, persist) and the restore that reads it back share the
checkpointer's state; the parts that need none are modules of their own (chain, fold, inplace,
sources, retention, restore).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import numbers
import os
import re
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan

from elastic_rm.checkpoint import owners, timeline
from elastic_rm.checkpoint.chain import DeltaTake, take_delta
from elastic_rm.checkpoint.collectives import all_gather_json, broadcast_bytes
from elastic_rm.checkpoint.delta_file import DELTA_SUFFIX, write_delta_entry
from elastic_rm.checkpoint.delta_tracker import TouchedRows
from elastic_rm.checkpoint.fold import (
    base_layout,
    buffer_pieces,
    clone_dense,
    copy_dense,
    folded_entry,
    roll_forward,
    writers_of,
)
from elastic_rm.checkpoint.inplace import fold_chain, folded_manifest, recover_fold
from elastic_rm.checkpoint.manifest import (
    BLOCK,
    DCP_METADATA,
    MANIFEST,
    CorruptCheckpointError,
    copy_file,
    file_entry,
    make_manifest,
    prune_steps,
    publish_dir,
    step_dirname,
    write_file,
)
from elastic_rm.checkpoint.node_memory import held_bytes, memory_dirs, run_memory_dir
from elastic_rm.checkpoint.peers import PeerClient, PeerEndpoint, PeerError, peers_from_env
from elastic_rm.checkpoint.plan_record import plan_digest, plan_summary
from elastic_rm.checkpoint.restore import RestoreResult, restore_checkpoint
from elastic_rm.checkpoint.restore_report import report_restore
from elastic_rm.checkpoint.retention import drop_newer_than
from elastic_rm.checkpoint.snapshot import Snapshotter, app_state
from elastic_rm.checkpoint.sources import (
    CheckpointSource,
    DirectorySource,
    HttpPeerSource,
    memory_sources,
    newest_timeline_of,
)
from elastic_rm.checkpoint.split_folds import finish_split_folds, held_folds
from elastic_rm.output_paths import output_dir_problem

log = logging.getLogger(__name__)

# see FlashCheckpointer.cpu_seconds
CPU_PARTS = ("pause", "fold", "memory", "replicate", "gather", "roll", "persist")


def _is_int(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An integer or a float, not a bool (NaN included: the callers' comparisons refuse it)."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _default_run_id() -> str:
    return os.environ.get("ERM_RUN_ID") or os.environ.get("TORCHELASTIC_RUN_ID") or "default"


@dataclass
class FlashConfig:
    """Where and how the flash checkpoint keeps its copies.

    node_id names this node's memory directory; it must be stable across rounds (the agent sets
    ERM_NODE_ID; the host name otherwise). durable_dir must be shared by all nodes (or local with one
    node); None disables persisting. persist_every: persist every n-th flash save.
    peers: the other members' checkpoint servers (node id -> endpoint), from ELASTIC_RM_CKPT_PEERS, which
    ermrun's agent sets; None (plain torchrun): no peers, so restores read local memory and durable only,
    and replicate=True has no peer to replicate to.
    differential: a save copies the dense state and only the embedding rows touched since this
    checkpointer's previous save (with their optimizer rows); the first save is full (a base). A save
    whose delta would take the chain's deltas past compact_ratio x its base's bytes is a fold: it pauses
    like a delta, and in the background the chain so far is first folded into its base in place, then
    the delta is written on top of it. A restart starts a new chain.
    """

    run_id: str = field(default_factory=_default_run_id)
    node_id: str = field(default_factory=lambda: os.environ.get("ERM_NODE_ID") or socket.gethostname())
    memory_root: Path | None = None
    durable_dir: Path | None = None
    persist_every: int = 1
    replicate: bool = False
    keep_memory: int = 2
    keep_durable: int = 2
    sync_durable: bool = True
    verify_checksums: bool = True  # False: restore checks sizes only (faster; misses flipped bytes)
    timeout_s: float = 600.0
    peers: dict[str, PeerEndpoint] | None = field(default_factory=peers_from_env)
    peer_timeout_s: float = 30.0  # per socket operation with a peer's checkpoint server
    differential: bool = False  # a save copies only the table rows touched since the previous save
    compact_ratio: float = 1.0  # a chain's deltas past this many times its base's bytes: next save folds

    def __post_init__(self) -> None:
        # checked here, not where they are used: a bad value would otherwise surface in the background
        # thread of the first save (a TypeError of a slice), or not at all (a NaN keep_memory passes
        # every comparison as False: node memory was never pruned, and a NaN keep_durable pruned the
        # durable copy's every step, the one just persisted included)
        for name in ("keep_memory", "keep_durable"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:  # 0 would prune every step, the one just committed included
                raise ValueError(
                    f"FlashConfig.{name} must be >= 1, an integer (got {value!r}): how many of the newest "
                    "steps to keep (with the chains they need); 1 keeps only the newest"
                )
            setattr(self, name, int(value))  # numpy's integers too: the keep goes into JSON and URLs
        if not _is_int(self.persist_every) or self.persist_every < 1:
            raise ValueError(
                f"FlashConfig.persist_every must be >= 1, an integer (got {self.persist_every!r}): every "
                "n-th flash save is persisted to durable_dir (durable_dir=None persists none)"
            )
        if not _is_number(self.compact_ratio) or not self.compact_ratio > 0:
            raise ValueError(
                f"FlashConfig.compact_ratio must be > 0, a number (got {self.compact_ratio!r}); 1.0 starts a "
                "new base once a chain's deltas hold as many bytes as its base"
            )
        for name in ("timeout_s", "peer_timeout_s"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < math.inf:
                raise ValueError(f"FlashConfig.{name} must be a finite number of seconds > 0 (got {value!r})")

    def root(self) -> Path:
        return Path(self.memory_root) if self.memory_root is not None else run_memory_dir(self.run_id)


@dataclass
class SaveStats:
    step: int
    pause_s: float  # time the step loop was held (snapshot, plus any wait for the previous save)
    waited_s: float  # part of the pause spent waiting for the previous background save
    bytes: int  # bytes copied on this rank (= bytes_copied)
    # "full" (a base), "delta" (rows touched since the previous save) or "fold" (in the background the
    # chain so far is folded into its base in place and this save's delta written on top; its pause
    # copies the touched rows, like a delta; a fold refused there writes this save in full instead)
    kind: str = "full"
    bytes_copied: int = 0
    rows_touched: int = 0  # of a delta: table rows touched since the previous save, over all ranks
    rows_total: int = 0  # rows of the tables taken by rows (rows_touched / rows_total: the touched fraction)
    tables_full: list[str] = field(default_factory=list)  # tables a delta copied whole (state not by row)
    # of a "full" save where the chain had passed its bound and a fold was due: why it could not fold
    # (it is a new base beside the chain, which holds more memory than the bound for that save)
    reason: str = ""


def _bytes_by_node(manifest: dict[str, Any]) -> dict[str, int]:
    """The bytes of a step's files each node holds (its own files and those of node "*")."""
    entries = manifest["files"].values()
    nodes = sorted({e["node"] for e in entries if e["node"] != "*"} | set(manifest.get("nodes") or ()))
    shared = sum(e["size"] for e in entries if e["node"] == "*")
    return {n: shared + sum(e["size"] for e in entries if e["node"] == n) for n in nodes}


class FlashCheckpointer:
    """Create after the DMP (collective: every rank calls it). See docs/train.md for the step loop."""

    def __init__(
        self,
        dmp: DistributedModelParallel,
        plan: ShardingPlan | None = None,
        dense_optimizer: torch.optim.Optimizer | None = None,
        config: FlashConfig | None = None,
    ) -> None:
        self.dmp = dmp
        self.plan = plan
        self.dense_optimizer = dense_optimizer
        self.cfg = config or FlashConfig()
        self.pg = dist.new_group(backend="gloo")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.rank_nodes: list[str] = all_gather_json(self.cfg.node_id, self.pg)
        self.node = self.cfg.node_id
        self.nodes = sorted(set(self.rank_nodes))
        self.leader = self.rank_nodes.index(self.node) == self.rank
        self.node_dir = self.cfg.root() / self.node
        # a directory the saves cannot write is said here, on every rank: found by the first save, it
        # failed in the background, and the other ranks then waited at its barrier for timeout_s
        problems = [p for p in all_gather_json(self._dir_problems(), self.pg) if p]
        if problems:
            raise ValueError("flash checkpoint: " + "; ".join(dict.fromkeys(problems)))
        if self.leader and self.node_dir.is_dir():
            recover_fold(self.node_dir)  # a fold a crash interrupted is finished (or dropped) first
        dist.barrier(group=self.pg)
        if self.cfg.memory_root is None and (owner := owners.script_owner()) is not None:
            owners.claim(self.cfg.root(), owner)  # `erm gc` keeps a live run's node memory
        self._snap = Snapshotter()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._saves = 0
        self.last_committed: int | None = None
        self.last_persisted: int | None = None
        self.last_replicated: int | None = None
        # the newest step committed on every node, every replica push of it included (all gathered):
        # the step a lost node can still restore from memory; a failed push leaves it behind
        self.replicated_everywhere: int | None = None
        self._push_failures: list[str] = []  # of the newest committed save, as wait() returns them
        # when the last save's background phases ended (wall clock): "memory" (this node's copy
        # committed), "replicated" (its replica pushed to the ring peer), "barrier" (every rank's done)
        self.last_phases: dict[str, float] = {}
        # CPU seconds this rank's saves spent, by part, since its start (thread CPU time, so training on
        # other threads does not count): "pause" (in save(): the touched ids, the copy), "memory" (this
        # node's files, checksums, the manifest's gather and publish), "replicate" (the push to the ring
        # peer), "gather" (every node's push result), "roll" (the rows written into the snapshot buffers),
        # "persist" (the durable copy)
        self.cpu_seconds: dict[str, float] = dict.fromkeys(CPU_PARTS, 0.0)
        self._warned_no_peer = False
        self._warned_no_layout = False  # a base without a layout: said once
        self.bytes_pushed = 0  # file bytes this node's leader sent to its ring peer, since its start
        # differential saves: the rows looked up since the last save, and the chain the next delta extends
        self._touched = TouchedRows(dmp) if self.cfg.differential else None
        self._chain: dict[str, Any] | None = None
        # the snapshot buffers (the last full save's snapshot) and the committed step whose state they
        # hold: differential saves roll them forward, so that a fold can write them as a new base
        self._buffers: dict | None = None
        self._rolled: int | None = None
        self._memory_peak = 0  # see memory_peak_bytes
        self._samples_due = 0  # publishes left to sample: a base's or a fold's and the next keep_memory
        self._plan_cache: dict[str, Any] | None = None
        # the timeline this checkpointer's saves belong to (timeline.py): set by restore()
        self._timeline: timeline.Key = timeline.ORIGIN
        self._peer_clients: dict[PeerEndpoint, PeerClient] = {}  # one kept connection per peer

    def _dir_problems(self) -> str | None:
        """Why the saves could not write this node's memory directory (on a node's first rank) or the
        durable directory (on rank 0): a path through a file, or one not writable; None: no problem.
        Nothing is created: the nearest existing directory on the way must be writable."""
        wanted = []
        if self.leader:
            name = "FlashConfig.memory_root" if self.cfg.memory_root is not None else "node memory"
            wanted.append((name, self.node_dir))
        if self.rank == 0 and self.cfg.durable_dir is not None:
            wanted.append(("FlashConfig.durable_dir", Path(self.cfg.durable_dir)))
        for name, path in wanted:
            if problem := output_dir_problem(str(path)):
                return f"{name} ({path}) {problem}"
        return None

    @property
    def memory_peak_bytes(self) -> int:
        """This node directory's bytes at their largest (its own steps, the replicas it keeps, temp
        directories), on a node's first rank (0 on the others). Sampled right before each fold (the
        chain at its largest), right before each publish after which a prune may remove steps (a
        base's or a fold's, and the next keep_memory ones: new files may sit beside an old chain),
        and now; in between a chain only grows, so these are its peaks."""
        if not self.leader:
            return 0
        return max(self._memory_peak, held_bytes(self.node_dir))

    # ---- saving -------------------------------------------------------------------------------
    def prepare(self) -> float:
        """Allocate (and page in) the snapshot buffers now, outside the step loop, so that the first
        save pauses as briefly as later ones. Costs one copy of this rank's state in memory."""
        t0 = time.perf_counter()
        self.wait()
        self._rolled = None  # the buffers now hold the live state, of no committed step
        self._snap.snapshot(app_state(self.dmp, self.dense_optimizer))
        return time.perf_counter() - t0

    def save(self, step: int, position: dict[str, Any] | None = None, block: bool = False) -> SaveStats:
        """Snapshot now (the step pause), write in the background. `position` (JSON) is the training
        position to resume from, e.g. {"step": ..., "ledger": ledger.checkpoint_state()}; rank 0's is kept.

        ``block``: return once committed. It snapshots too: writing the live state instead copies as
        much (DCP clones a tensor that views a larger storage, as TorchRec's fused tables do) into new
        memory at every save, and a kept worker grew more over 20 rounds in place (docs/benchmarks.md).

        A save that raises (here, or the previous save's error that wait() raises) leaves no chain to
        extend: the rows it took from the tracker are in no checkpoint, so the next save is a new base."""
        if not _is_int(step) or step < 0:  # -1 made "step--0000001", which no listing, restore or prune sees
            raise ValueError(f"flash checkpoint: step must be an integer >= 0 (got {step!r})")
        try:
            return self._save(int(step), position, block)  # int: numpy's does not go into JSON
        except BaseException:
            self._chain = None  # a delta on the old chain would miss the rows taken (a silent restore)
            raise

    def _save(self, step: int, position: dict[str, Any] | None, block: bool) -> SaveStats:
        t0 = time.perf_counter()
        self.wait()
        waited = time.perf_counter() - t0
        cpu0 = time.thread_time()
        pos_json = json.dumps(position if position is not None else {"step": step})
        snap: dict | DeltaTake
        dense = None  # a fold's dense tensors, for the buffers once the chain before it is folded
        kind = self._save_kind(step)
        reason = ""  # why a fold that was due is a full save instead
        roll = False  # this save's rows go into the snapshot buffers once committed
        delta: DeltaTake | None = None
        if kind != "full":
            assert self._touched is not None and self._chain is not None
            touched = self._touched.take(self.pg)  # every rank's ids
            live = app_state(self.dmp, self.dense_optimizer)
            writers = self._chain.get("writers")
            delta = take_delta(live, touched, self._touched.tables, self.rank, writers)
            kind, reason = self._delta_or_fold(delta.bytes)
        if delta is not None and kind != "full":
            assert self._chain is not None
            snap = delta
            copied = snap.bytes
            roll = self._buffers is not None and self._rolled == self._chain["parent"]
            if roll and kind == "fold":  # the buffers must hold the chain's newest step until folded
                dense = clone_dense(live)
                copied += copy_dense(dense, live)
            elif roll:
                assert self._buffers is not None
                copied += copy_dense(self._buffers, live)  # a delta file holds them from one rank only
            stats = SaveStats(
                step,
                time.perf_counter() - t0,
                waited,
                copied,
                kind,
                copied,
                snap.rows_touched,
                snap.rows_total,
                snap.tables_full,
            )
        else:
            if self._touched is not None and not self._touched.attached:
                # a save after close() (ElasticTraining closes at the end of each steps() call, and a
                # script may call it again): the rows looked up since went unrecorded, so this save is a
                # new base, and the saves after it are deltas again (they were all full)
                self._touched = TouchedRows(self.dmp)
            elif self._touched is not None:
                self._touched.forget()  # a full save holds every row
            self._snap.bytes_copied = 0
            snap = self._snap.snapshot(app_state(self.dmp, self.dense_optimizer))
            self._buffers, roll = snap, True
            pause = time.perf_counter() - t0
            copied = self._snap.bytes_copied
            stats = SaveStats(step, pause, waited, copied, "full", copied, reason=reason)
        self._rolled = None  # set again once this step is committed
        self._saves += 1
        persist = self.cfg.durable_dir is not None and self._saves % max(1, self.cfg.persist_every) == 0
        self.cpu_seconds["pause"] += time.thread_time() - cpu0
        self._thread = threading.Thread(
            target=self._run,
            args=(step, snap, pos_json, persist, kind, roll, dense),
            name=f"erm-flash-{step}",
            daemon=True,
        )
        self._thread.start()
        if block:
            self.wait()
        return stats

    def wait(self, timeout: float | None = None) -> list[str]:
        """Block until the background save is committed (and persisted, if due); re-raise its error.
        Returns the replica pushes of the newest committed save that failed ("node -> peer: step N:
        why"; empty: none failed): that step is committed in memory on every node, but it is not
        replicated everywhere (see replicated_everywhere)."""
        if self._thread is not None:
            self._thread.join(timeout if timeout is not None else self.cfg.timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(
                    f"flash checkpoint still writing after {timeout or self.cfg.timeout_s:.0f}s; a peer "
                    "rank may have died. Raise FlashConfig.timeout_s if the disk is slow."
                )
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"background flash checkpoint failed: {err}") from err
        return list(self._push_failures)

    def _save_kind(self, step: int) -> str:
        """Which save this is. "delta": extends the chain of the previous save. "full" (a new base, a
        full snapshot) when there is none (the first save, or the previous one failed), the step is not
        after the previous one (saving a step again replaces its directory: a delta would replace its own
        parent) or the tracker is closed. A delta may still become a fold (_delta_or_fold). Every rank
        decides alike from the same committed manifests."""
        c = self._chain
        if c is None or self._touched is None or not self._touched.attached:  # closed: nothing recorded
            return "full"
        if step <= c["parent"]:
            return "full"
        return "delta"

    def _delta_or_fold(self, nbytes: int) -> tuple[str, str]:
        """ "delta", or "fold" when this delta would take any node's deltas past compact_ratio x that
        node's own files of the base: the chain so far is then folded into its base in place before
        this delta is written on top, so no node's memory holds more than its base and deltas within
        the bound (with skewed tables one node's deltas grow much faster than the others', so a bound
        on the whole chain would not bound each node). A fold needs the base's layout and every rank's
        snapshot buffers holding the chain's newest step; without them (after prepare()) the save is
        "full" (a new base beside the chain). A delta that alone passes the bound on a chain without
        deltas is written; the next save folds. One gather of every rank's delta size: all ranks
        decide alike. Returns the kind and, for "full", why it cannot fold."""
        c = self._chain
        assert c is not None
        ready = self._buffers is not None and self._rolled == c["parent"]
        parts = all_gather_json([nbytes, ready], self.pg)
        if len(c["steps"]) < 2:
            return "delta", ""
        grown = dict(c["delta_bytes"])
        for rank, (n, _) in enumerate(parts):
            node = self.rank_nodes[rank]
            grown[node] = grown.get(node, 0) + n
        ratio = self.cfg.compact_ratio
        if all(n <= ratio * c["base_bytes"].get(node, 0) for node, n in grown.items()):
            return "delta", ""
        if not c.get("layout"):
            return "full", "the chain's base has no layout: it cannot be folded in place"
        if not all(r for _, r in parts):
            return (
                "full",
                "the snapshot buffers do not hold the chain's newest step (prepare() refilled them)",
            )
        return "fold", ""

    def _run(
        self,
        step: int,
        snap: dict | DeltaTake,
        pos_json: str,
        persist: bool,
        kind: str,
        roll: bool,
        dense: Any = None,
    ) -> None:
        phases: dict[str, float] = {}
        self.last_phases = phases
        chain, self._chain = self._chain, None  # set again once this step is committed
        cpu = [time.thread_time()]

        def spent(part: str) -> None:  # this thread's CPU since the previous part ended goes to `part`
            now = time.thread_time()
            self.cpu_seconds[part] += now - cpu[0]
            cpu[0] = now

        try:
            if kind == "fold":  # the chain so far becomes its base, in place; this delta goes on top
                assert chain is not None and isinstance(snap, DeltaTake) and self._buffers is not None
                try:
                    chain = self._fold(chain)
                except CorruptCheckpointError as e:  # every rank hears of it through the gathers
                    # the buffers hold the chain's newest step: with this delta's rows they hold this
                    # step, written as a new base (the chain, or what of it a refused fold kept, stays)
                    log.warning("flash checkpoint: step %d is saved in full: %s", step, e)
                    chain = None
                    roll_forward(self._buffers, snap)
                    snap, kind = self._buffers, "full"
                if dense is not None:
                    copy_dense(self._buffers, dense)
                spent("fold")
            manifest = self._commit_memory(step, snap, pos_json, chain)
            phases["memory"] = time.time()
            spent("memory")
            failed = self._replicate(step, manifest) if self.cfg.replicate else None
            if self.cfg.replicate:
                phases["replicated"] = time.time()
            spent("replicate")
            # each leader's push result, gathered: a step counts as replicated only where every push went
            failures = [f for f in all_gather_json(failed, self.pg) if f]
            phases["barrier"] = time.time()
            spent("gather")
            self.last_committed = step
            self._push_failures = failures
            if not failures:
                self.replicated_everywhere = step
            if kind != "full" and roll:
                assert self._buffers is not None and isinstance(snap, DeltaTake)
                roll_forward(self._buffers, snap)
            if roll:
                self._rolled = step
            spent("roll")
            chain = self._extended(chain, manifest)
            if persist:
                for s in self._durable_missing(chain["steps"]):
                    self._persist(s, manifest if s == step else self._memory_manifest(s))
                self.last_persisted = step
                spent("persist")
            if self._touched is not None:
                self._chain = chain
        except BaseException as e:  # surfaced by wait()
            log.exception("flash checkpoint of step %d failed", step)
            self._error = e
            if self.leader:  # what the save wrote (no space left, say) must not hold node memory until
                # a later save succeeds: kept, it took the room that save needed
                shutil.rmtree(self.node_dir / (step_dirname(step) + ".tmp"), ignore_errors=True)

    @staticmethod
    def _extended(chain: dict[str, Any] | None, manifest: dict[str, Any]) -> dict[str, Any]:
        """The chain after committing `manifest`: a new one for a full step. Its bytes are counted by
        node (a file of node "*" is held on every node): the fold's bound is each node's."""
        size = _bytes_by_node(manifest)
        link = {"parent": manifest["step"], "parent_sha256": manifest["manifest_sha256"]}
        if manifest.get("kind") != "delta" or chain is None:
            return {
                **link,
                "base": manifest["step"],
                "base_sha256": manifest["manifest_sha256"],
                "base_bytes": size,
                "delta_bytes": dict.fromkeys(size, 0),
                "steps": [[manifest["step"], manifest["manifest_sha256"]]],
                "layout": manifest.get("layout"),  # where a fold in place writes the rows
                "writers": writers_of(manifest),
            }
        return {
            **chain,
            **link,
            "delta_bytes": {n: chain["delta_bytes"].get(n, 0) + size.get(n, 0) for n in chain["base_bytes"]},
            "steps": [*chain["steps"], [manifest["step"], manifest["manifest_sha256"]]],
        }

    def _fold(self, chain: dict[str, Any]) -> dict[str, Any]:
        """Fold the chain (its base and its deltas up to its newest step, S) into its base in place, in
        every node's memory, and then in the ring peer's replica; returns the chain of the new base, S.
        The new base's manifest comes first: each rank computes its files' checksums from its snapshot
        buffers (they hold step S), one gather gives every rank every entry; each node's leader then
        folds its directory (inplace.fold_chain) and one more gather says whether every node did."""
        base, top = chain["base"], chain["parent"]
        base_m, top_m = self._memory_manifest(base), self._memory_manifest(top)
        pieces = buffer_pieces(self._buffers)
        mine: dict[str, Any] | str = {}
        try:
            for name, items in base_m["layout"].items():
                entry = base_m["files"][name]
                if entry["rank"] == self.rank:
                    path = self.node_dir / step_dirname(base) / name
                    new = folded_entry(path, items, pieces, entry.get("block", BLOCK))
                    mine[name] = {**entry, **new}
        except Exception as e:  # every rank must reach the gather below and hear of it: nothing was touched
            mine = f"rank {self.rank}: {type(e).__name__}: {e}"
        parts = all_gather_json(mine, self.pg)
        if any(isinstance(part, str) for part in parts):
            why = "; ".join(p for p in parts if isinstance(p, str))
            raise CorruptCheckpointError(f"fold of steps {base}..{top}: {why}")
        files: dict[str, Any] = {}
        for part in parts:
            files.update(part)
        body = folded_manifest(base_m, top_m, files)
        failed = None
        if self.leader:
            self._memory_peak = max(self._memory_peak, held_bytes(self.node_dir))  # the chain at its largest
            try:
                fold_chain(self.node_dir, body)
            except Exception as e:  # every rank must reach the gather below, whatever failed here
                recover_fold(self.node_dir)  # a fold cut short here is finished or dropped now
                failed = f"{self.node}: {type(e).__name__}: {e}"
        failures = [f for f in all_gather_json(failed, self.pg) if f]
        if failures:
            raise CorruptCheckpointError(f"fold of steps {base}..{top} failed: {'; '.join(failures)}")
        if self.leader:  # the folded chain holds fewer steps: prune as after a base until an old chain goes
            self._samples_due = self.cfg.keep_memory + 1
        if self.cfg.replicate:
            self._push_fold(top, body)
        return self._extended(None, json.loads(body))

    def _push_fold(self, step: int, body: bytes) -> None:
        """Ask the ring peer to fold this node's replica the same way, from the deltas it holds: no base
        crosses the network. When it cannot (it lacks the chain, or an older server), the next delta's
        push finds the base missing there and sends it (PeerClient.push_replica)."""
        peer = self.peer_of(self.node)
        endpoint = (self.cfg.peers or {}).get(peer) if peer is not None else None
        if not self.leader or endpoint is None:
            return
        try:
            client = self._peer_clients.get(endpoint)
            if client is None:
                client = self._peer_clients[endpoint] = PeerClient(endpoint, self.cfg.peer_timeout_s)
            client.fold_replica(self.node, step, body, self.cfg.keep_memory, self.cfg.timeout_s)
            self.last_replicated = step
        except (PeerError, OSError) as e:
            log.info(
                "flash checkpoint: %s did not fold its replica to step %d (%s); it gets the base",
                peer,
                step,
                e,
            )

    def _memory_manifest(self, step: int) -> dict[str, Any]:
        return json.loads((self.node_dir / step_dirname(step) / MANIFEST).read_bytes())

    def _durable_missing(self, steps: list[list[Any]]) -> list[int]:
        """Steps of the chain ([step, manifest digest] pairs) the durable copy lacks or holds another
        checkpoint of (a delta is useless there without its own chain); rank 0 looks, so that every
        rank copies the same steps."""
        assert self.cfg.durable_dir is not None
        durable = Path(self.cfg.durable_dir)

        def held(step: int, sha: str) -> bool:
            try:
                doc = json.loads((durable / step_dirname(step) / MANIFEST).read_bytes())
            except (OSError, ValueError, RecursionError):
                return False
            return isinstance(doc, dict) and doc.get("manifest_sha256") == sha

        missing = None
        if self.rank == 0:
            missing = json.dumps([s for s, sha in steps if not held(s, sha)]).encode()
        return json.loads(broadcast_bytes(missing, 0, self.pg))

    def _commit_memory(
        self, step: int, snap: dict | DeltaTake, pos_json: str, chain: dict[str, Any] | None
    ) -> dict[str, Any]:
        """Write this rank's files into the step's temp directory; then one all-gather gives every rank
        every file's entry and rank 0's part of the manifest (position, time, plan), from which each
        builds the same manifest, and each node's leader publishes its directory. A full step's
        `.metadata` (rank 0's) is broadcast besides."""
        tmp = self.node_dir / (step_dirname(step) + ".tmp")
        link: dict[str, Any] = {"kind": "full"}
        written: dict[Path, dict[str, Any]] = {}  # the entries of the files hashed as they were written
        layout: dict[str, Any] | None = None
        if isinstance(snap, DeltaTake):
            assert chain is not None
            # no barrier first: a delta's temp directory is new (after a failed save the next one is
            # full, and a restore removes the temp directories of the steps after it), so every rank
            # may make it
            tmp.mkdir(parents=True, exist_ok=True)
            path = tmp / f"__{self.rank}_delta{DELTA_SUFFIX}"
            written[path] = write_delta_entry(path, snap.pieces)  # its entry, hashed as written
            link = {
                "kind": "delta",
                **{k: chain[k] for k in ("base", "base_sha256", "parent", "parent_sha256")},
            }
        else:
            if self.leader:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier(group=self.pg)
            writer = FileSystemWriter(tmp, sync_files=False, thread_count=1, overwrite=True)
            md = dcp.save(snap, storage_writer=writer, process_group=self.pg)
            if self._touched is not None:  # a differential chain's base: where a fold writes rows
                layout = base_layout(md, tmp, self.rank, snap)
                if layout is None and not self._warned_no_layout:
                    self._warned_no_layout = True
                    log.warning(
                        "flash checkpoint: rank %d's files of the base of step %d are not plain copies of "
                        "its tensors: this chain cannot be folded in place, and its compaction is a full "
                        "save beside it (SaveStats.reason)",
                        self.rank,
                        step,
                    )
        mine = {
            p.name: {**written[p], "node": self.node, "rank": self.rank}
            if p in written
            else file_entry(p, node=self.node, rank=self.rank)
            for p in sorted(tmp.glob(f"__{self.rank}_*"))
        }
        head: dict[str, Any] | None = None
        if self.rank == 0:
            head = {
                "position": json.loads(pos_json),
                "created_unix": time.time(),
                "timeline": timeline.as_field(self._timeline),
                **self._plan_fields(),
            }
            if link["kind"] == "full":
                head["metadata"] = file_entry(tmp / DCP_METADATA, node="*", rank=0)
        parts = all_gather_json({"files": mine, "head": head, "layout": layout}, self.pg)
        files: dict[str, Any] = {}
        for part in parts:
            files.update(part["files"])
        head = parts[0]["head"]
        if link["kind"] == "full" and all(part["layout"] is not None for part in parts):
            head["layout"] = {name: items for part in parts for name, items in part["layout"].items()}
        if "metadata" in head:
            files[DCP_METADATA] = head.pop("metadata")
        body = make_manifest(
            {**link, **head, "step": step, "world_size": self.world, "nodes": self.rank_nodes, "files": files}
        )
        meta = None
        if link["kind"] == "full":
            meta = broadcast_bytes((tmp / DCP_METADATA).read_bytes() if self.rank == 0 else None, 0, self.pg)
        if self.leader:
            if meta and not (tmp / DCP_METADATA).exists():
                write_file(tmp / DCP_METADATA, meta, sync=False)
            write_file(tmp / MANIFEST, body, sync=False)
            if link["kind"] == "full":
                self._samples_due = self.cfg.keep_memory + 1
            # a prune may remove steps only after a base's (or a fold's: _fold) publish and the next
            # keep_memory ones (the old chain goes once the new one holds keep_memory steps); after
            # those, a delta only extends the kept chain, and a prune would read every manifest of it
            # for nothing
            may_prune = self._samples_due > 0 or self.cfg.keep_memory < 1
            if self._samples_due > 0:
                self._samples_due -= 1
                self._memory_peak = max(self._memory_peak, held_bytes(self.node_dir))
            publish_dir(tmp, self.node_dir / step_dirname(step), sync=False)
            if may_prune:
                prune_steps(self.node_dir, self.cfg.keep_memory)
        return json.loads(body)

    def _plan_fields(self) -> dict[str, Any]:
        """The plan's summary and digest for a manifest, computed once (a checkpointer's plan is fixed)."""
        if self._plan_cache is None:
            p = self.plan
            self._plan_cache = {
                "plan": plan_summary(p) if p is not None else None,
                "plan_digest": plan_digest(p) if p is not None else None,
            }
        return self._plan_cache

    def peer_of(self, node: str) -> str | None:
        """The node that holds `node`'s replica: the next one in sorted order (a ring)."""
        if len(self.nodes) < 2:
            return None
        return self.nodes[(self.nodes.index(node) + 1) % len(self.nodes)]

    def _replicate(self, step: int, manifest: dict[str, Any]) -> str | None:
        """Push this node's files of `step` (and .metadata) to its ring peer's checkpoint server, which
        checks them against the manifest and commits them atomically. A failure is returned ("node ->
        peer: why"), not raised: the memory copy is committed; only the protection against losing this
        node is missing for this step, and the step does not count as replicated everywhere. None: pushed,
        or nothing to push (not the leader, a world of one node, no peer server: warned once)."""
        peer = self.peer_of(self.node)
        if not self.leader or peer is None:
            return None
        endpoint = (self.cfg.peers or {}).get(peer)
        if endpoint is None:
            if not self._warned_no_peer:
                self._warned_no_peer = True
                log.warning(
                    "flash checkpoint: not replicating to %s: it has no checkpoint server in %s (replication "
                    "needs ermrun's agents; under plain torchrun only the durable copy survives a lost node)",
                    peer,
                    "ELASTIC_RM_CKPT_PEERS" if self.cfg.peers is not None else "FlashConfig.peers (unset)",
                )
            return None
        src = self.node_dir / step_dirname(step)
        files = sorted(n for n, e in manifest["files"].items() if e["node"] in (self.node, "*"))
        t0 = time.perf_counter()
        try:
            client = self._peer_clients.get(endpoint)
            if client is None:
                client = self._peer_clients[endpoint] = PeerClient(endpoint, self.cfg.peer_timeout_s)
            sent = client.push_replica(
                self.node, step, src, files, (src / MANIFEST).read_bytes(), self.cfg.keep_memory
            )
            self.bytes_pushed += sent
        except (PeerError, OSError) as e:
            log.warning(
                "flash checkpoint: replica of step %d to %s failed (%s); if this node is lost before the "
                "next save, its shards of step %d come from the durable copy",
                step,
                peer,
                e,
                step,
            )
            return f"{self.node} -> {peer}: step {step}: {e}"
        self.last_replicated = step
        log.info(
            "flash checkpoint: step %d replicated to %s (%d bytes in %.2fs)",
            step,
            peer,
            sent,
            time.perf_counter() - t0,
        )
        return None

    def _persist(self, step: int, manifest: dict[str, Any]) -> None:
        """Copy every node's files into <durable>/step-N.tmp, then rank 0 publishes it atomically."""
        assert self.cfg.durable_dir is not None
        durable = Path(self.cfg.durable_dir)
        tmp = durable / (step_dirname(step) + ".tmp")
        sync = self.cfg.sync_durable
        try:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier(group=self.pg)
            src = self.node_dir / step_dirname(step)
            if self.leader:
                for name, entry in manifest["files"].items():
                    if entry["node"] == self.node:
                        copy_file(src / name, tmp / name, sync=sync)
            dist.barrier(group=self.pg)
            if self.rank == 0:
                if DCP_METADATA in manifest["files"]:
                    copy_file(src / DCP_METADATA, tmp / DCP_METADATA, sync=sync)
                copy_file(src / MANIFEST, tmp / MANIFEST, sync=sync)
                publish_dir(tmp, durable / step_dirname(step), sync=sync)
        except BaseException:
            if self.rank == 0:  # a copy cut short (no space left on the durable disk) does not stay there
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        if self.rank == 0:
            prune_steps(durable, self.cfg.keep_durable)

    # ---- restoring ----------------------------------------------------------------------------
    def sources(self) -> list[CheckpointSource]:
        """Fastest first: this node's memory (with the replicas it holds), the other members' memory
        over HTTP (when the agent gave us their servers), the durable copy."""
        out = memory_sources(f"local:{self.node}", self.node_dir)
        peers = self.cfg.peers or {}
        cache = self.node_dir / "fetch" / f"rank{self.rank}"  # this node's memory, never a step directory
        out += [
            HttpPeerSource(peers[n], cache / n, self.cfg.peer_timeout_s)
            for n in sorted(peers)
            if n != self.node
        ]
        if self.cfg.durable_dir is not None:
            out.append(DirectorySource("durable", Path(self.cfg.durable_dir)))
        return out

    def restore(self, sources: list[CheckpointSource] | None = None) -> RestoreResult | None:
        """Load the newest good checkpoint into this world's model (collective). None: nothing saved
        yet (fresh start). Raises CorruptCheckpointError when checkpoints exist but none is good."""
        self.wait()
        self._chain = None  # the model is about to change under the chain: the next save is a base
        self._rolled = None
        self._drop_stale_fetches()
        srcs = sources or self.sources()
        self._finish_split_folds()
        current = self._current_timeline(srcs)
        try:
            result = restore_checkpoint(
                self.dmp,
                self.dense_optimizer,
                srcs,
                self.pg,
                self.rank,
                self.cfg.verify_checksums,
                live=lambda manifest: timeline.is_live(current, manifest),
            )
            if result is not None:
                restored = timeline.key_of(result.manifest)
                # newer steps were passed over: the steps saved from here reuse their numbers
                abandons = bool(result.skipped) or restored != current
                self._timeline = timeline.forked(current, result.manifest) if abandons else restored
                self._drop_newer_than(result.step, current)
                report_restore(result, self.world)  # the reporter counts global steps from here
            return result
        finally:
            for src in srcs:
                if isinstance(src, HttpPeerSource):
                    if src.bytes_fetched:
                        log.info("restore: %d bytes fetched from %s", src.bytes_fetched, src.name)
                    src.clear()

    def _drop_stale_fetches(self) -> None:
        """Drop what an earlier restore downloaded into this node's memory and could not drop itself (a
        worker killed mid-restore): each source drops only its own peer's copies when a restore ends, so
        the copies of a peer gone since, or of a rank no longer on this node, stayed until the job's end.
        Each rank drops its own ``fetch/rank<r>``; the node's first rank those of ranks not on this node
        in this world (no rank of this world uses them). Other names there (a cache a script gave its
        own sources) are left alone."""
        fetch = self.node_dir / "fetch"
        shutil.rmtree(fetch / f"rank{self.rank}", ignore_errors=True)
        if self.leader and fetch.is_dir():
            here = {f"rank{r}" for r, node in enumerate(self.rank_nodes) if node == self.node}
            for p in fetch.iterdir():
                if re.fullmatch(r"rank\d+", p.name) and p.name not in here:
                    shutil.rmtree(p, ignore_errors=True)

    def _finish_split_folds(self) -> None:
        """A fold that ran on some nodes (or a node's own memory) and not on others (or its replica on
        the peer) is finished everywhere before the steps are read (split_folds.py). Collective."""
        dirs = memory_dirs(self.node_dir) if self.leader else []
        offers, tops = held_folds(dirs)
        held = all_gather_json([sorted(offers), tops], self.pg)  # digests only: small
        wanted = {sha for _, tops in held for sha in tops} & {sha for folded, _ in held for sha in folded}
        givers = {sha: min(r for r, (folded, _) in enumerate(held) if sha in folded) for sha in wanted}
        mine = {sha: offers[sha] for sha, r in givers.items() if r == self.rank}
        bodies = {sha: text for part in all_gather_json(mine, self.pg) for sha, text in part.items()}
        finish_split_folds(dirs, bodies)
        dist.barrier(group=self.pg)  # no rank lists steps while a leader folds

    def _checkpoint_dirs(self) -> list[Path]:
        """The directories this rank tends at a restore: its node's memory and the replicas it holds (on
        the node's first rank), and the durable copy (on rank 0)."""
        dirs = memory_dirs(self.node_dir) if self.leader else []
        if self.rank == 0 and self.cfg.durable_dir is not None:
            dirs.append(Path(self.cfg.durable_dir))
        return dirs

    def _current_timeline(self, sources: list[CheckpointSource]) -> timeline.Key:
        """The newest timeline that a sound manifest in any source of any rank names (timeline.py): the
        vote reads every source the restore may read (the nodes that serve checkpoints, members of the
        round or not, and the durable copy). Collective."""
        mine = newest_timeline_of(sources)
        # the timeline an earlier restore of this checkpointer chose counts too: a fork shows itself by
        # its saves, and a second restore before the first save (a member lost again, rounds in place)
        # would otherwise take the abandoned timeline back, and the next saves would reuse its numbers
        if self._timeline != timeline.ORIGIN and (mine is None or self._timeline > mine):
            mine = self._timeline
        held = all_gather_json(timeline.as_field(mine) if mine is not None else None, self.pg)
        return max((k for k in map(timeline.from_json, held) if k is not None), default=timeline.ORIGIN)

    def _drop_newer_than(self, step: int, current: timeline.Key) -> None:
        """Steps newer than the one restored were refused (or incomplete): training goes on from
        ``step`` and saves steps with their numbers again, so the old ones go, from this node's memory
        (the replicas it holds for peers included: a restore must never mix them with a new step) and the
        durable copy; kept, retention would count them as the newest and prune the new chain. Steps of a
        timeline off `current`'s history (a node out of reach at an earlier restore kept them) go too.
        Collective: no rank saves before every directory is clean."""
        for directory in self._checkpoint_dirs():
            for dropped in drop_newer_than(directory, step, current):
                log.info(
                    "restore: dropped step %d in %s (%s)",
                    dropped,
                    directory,
                    f"newer than the restored step {step}" if dropped > step else "of an abandoned timeline",
                )
        dist.barrier(group=self.pg)

    def close(self, finished: bool = False) -> None:
        """Finish the background save and free the snapshot buffers; call before destroying the group
        (collective with ``finished``). ``finished``: the job is done; under plain torchrun this node's
        memory copies are then freed (durable copies stay; an ermrun agent frees them itself)."""
        try:
            self.wait()
        finally:
            self._snap.clear()
            self._buffers, self._rolled = None, None
            for client in self._peer_clients.values():
                client.close()
            self._peer_clients.clear()
            if self._touched is not None:
                self._touched.detach()
            gc.collect()
        if finished and self.cfg.memory_root is None:
            dist.barrier(group=self.pg)  # every rank of this node is done with its memory copies
            if self.leader and owners.free_finished(self.cfg.root(), self.node_dir):
                log.info("job finished: freed this node's memory copies in %s", self.node_dir)


__all__ = ["CorruptCheckpointError", "FlashCheckpointer", "FlashConfig", "RestoreResult", "SaveStats"]
