"""A complete TorchRec DLRM training job: the template for your own elastic jobs.

Runs unchanged under `torchrun` (a fixed world) and `ermrun` (elastic: the world may grow and shrink
between restarts). What makes it elastic, in order of appearance:

1. Tables are sharded for the world at hand (`plan_sharding` under the elastic rules, `wrap_model`).
2. The loss is a mean over a fixed global batch, so learning-rate semantics do not change with the
   world size (gradients are averaged over ranks).
3. Samples come from a sample ledger (`GlobalBatches` over a `RangeLedger`): the dataset is cut into
   ranges of --range-steps global batches, the world takes one range at a time, and each step trains on
   the next global batch of it, split evenly over the ranks. The ledger state (ranges done, progress in
   the current one) is saved in every checkpoint, so the done marks commit with the model state that
   contains their effect; after a restore, everything the checkpoint does not contain is handed out
   again, and nothing it contains is. The agent that leads the run mirrors the checkpointed ledger to
   etcd (`erm status` shows it).
4. A flash checkpoint every --checkpoint-every steps (node memory first, durable copy in the
   background), and a final one when the agent drains the workers before a new round.
5. On start, the newest good checkpoint is restored into this world's sharding plan.

Run: `ermrun --nproc-per-node 2 examples/dlrm/train.py --steps 200` (or the same with torchrun).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torchrec.optim as trec_optim
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.planner.proposers import GreedyProposer
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from elastic_rm.checkpoint.snapshot import local_pieces
from elastic_rm.train import (
    FlashCheckpointer,
    FlashConfig,
    GlobalBatches,
    RangeLedger,
    RestoreResult,
    SyntheticClickData,
    WorldTopology,
    check_plan_agreement,
    dense_parameters,
    plan_sharding,
    wrap_model,
)
from elastic_rm.train.data import check_zipf_exponent
from elastic_rm.train.report import get_reporter
from elastic_rm.train.rounds import Round, rounds
from elastic_rm.train.state_digest import digest_hex, piece_digest
from elastic_rm.train.world_sizes import check_global_batch

IMPORTED_AT = time.time()  # the script's imports done (a profile of the first round: its "start" row)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=0, help="stop after this global step (0: until <progress-dir>/stop)"
    )
    p.add_argument("--global-batch", type=int, default=840, help="samples per step over all ranks (fixed)")
    p.add_argument("--tables", type=int, default=8, help="embedding tables (one sparse feature each)")
    p.add_argument("--rows", type=int, default=20_000, help="rows per table")
    p.add_argument("--dim", type=int, default=16, help="embedding dimension")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument(
        "--range-steps",
        type=int,
        default=10,
        help="global batches per range of the sample ledger (the ledger changes once per range)",
    )
    p.add_argument("--checkpoint-every", type=int, default=20, help="flash checkpoint every n steps")
    p.add_argument(
        "--checkpoint-dir", default=None, help="durable checkpoint directory (shared by all nodes)"
    )
    p.add_argument(
        "--persist-every",
        type=int,
        default=5,
        help="persist every n-th flash checkpoint to --checkpoint-dir (the final one: when its count is due)",
    )
    p.add_argument(
        "--differential",
        action="store_true",
        help="differential flash checkpoints: a save copies only the table rows touched since the "
        "previous one (docs/train.md)",
    )
    p.add_argument("--progress-dir", default=None, help="write one JSON line per step here (for erm demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--zipf",
        type=float,
        default=1.0,
        help="exponent of the power law of the synthetic sparse ids: 1.05-1.2 is like click logs "
        "(few rows change between checkpoints), 0 uniform (default: 1)",
    )
    p.add_argument(
        "--pace",
        type=float,
        default=0.0,
        help="at most this many steps per second (0: as fast as it goes; soaks)",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="keep this process across rounds under ermrun (elastic_rm.train.rounds; docs/train.md)",
    )
    p.add_argument(
        "--raise-in-place-on-rank",
        type=int,
        default=None,
        help="fault injection for tests: this global rank raises when it re-initialises in place",
    )
    p.add_argument(
        "--raise-at-step",
        type=int,
        default=0,
        help="fault injection for tests: global rank 1 raises after this step of a fresh start (0: never)",
    )
    p.add_argument(
        "--checksum-every",
        type=int,
        default=0,
        help="log the state checksum every n steps to the progress file (0: only at start, drain and end)",
    )
    args = p.parse_args()
    try:
        check_zipf_exponent(args.zipf)
    except ValueError as exc:
        p.error(f"--zipf: {exc}")
    # refused here, not after the build and restore: --checkpoint-every 0 failed the first step with a
    # ZeroDivisionError (step % 0), --range-steps 0 the ledger with a traceback
    for flag in ("checkpoint_every", "range_steps"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    return args


def build_model(args: argparse.Namespace) -> tuple[DLRMTrain, list[EmbeddingBagConfig]]:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=args.dim, num_embeddings=args.rows, feature_names=[f"cat_{i}"]
        )
        for i in range(args.tables)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[32, args.dim],
        over_arch_layer_sizes=[32, 1],
        dense_device=torch.device("cpu"),
    )
    return DLRMTrain(dlrm), tables


def init_tables(dmp: torch.nn.Module, tables: list[EmbeddingBagConfig], seed: int) -> None:
    """Deterministic initial rows, whatever the sharding: each rank fills the pieces it holds."""
    sd = dmp.state_dict()
    with torch.no_grad():
        for i, t in enumerate(tables):
            full = torch.empty(t.num_embeddings, t.embedding_dim).uniform_(
                -0.05, 0.05, generator=torch.Generator().manual_seed(seed * 1000 + i)
            )
            key = next(k for k in sd if k.endswith(f"embedding_bags.{t.name}.weight"))
            for off, loc in local_pieces(sd[key]):
                loc.copy_(full[off[0] : off[0] + loc.shape[0], off[1] : off[1] + loc.shape[1]])


def checksum_part(
    dmp: torch.nn.Module, dense_opt: torch.optim.Optimizer
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of :func:`state_checksum`: (float64 sums, int64 digests) of the pieces it holds
    (replicated tensors: rank 0 only). Adding every rank's part gives the whole state's; no collective."""
    sums = torch.zeros(3, dtype=torch.float64)
    digests = torch.zeros(3, dtype=torch.int64)

    def add(i: int, name: str, value: object) -> None:
        if not isinstance(value, ShardedTensor | torch.Tensor):
            return
        if not isinstance(value, ShardedTensor) and dist.get_rank() != 0:
            return  # replicated on every rank: count rank 0's copy only
        for off, loc in local_pieces(value):
            sums[i] += loc.double().sum() + (loc.double() ** 2).sum()
            digests[i] += piece_digest(name, off, loc)

    for key, value in dmp.state_dict().items():
        add(0 if "embedding_bags" in key else 2, key, value)
    for param, per_param in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in per_param.items():
            add(1, f"{param}/{name}", value)
    for g, group in enumerate(dense_opt.param_groups):
        for n, p in enumerate(group["params"]):
            for name, value in dense_opt.state.get(p, {}).items():
                add(2, f"dense_opt/{g}/{n}/{name}", value)
    return sums, digests


def state_checksum(dmp: torch.nn.Module, dense_opt: torch.optim.Optimizer) -> dict[str, object]:
    """Digests of the whole training state, the same at any world size, for (embedding rows, the fused
    optimizer's state, dense weights and their optimizer's state). `checksum`: exact, from every value
    keyed by its table and global row and column (elastic_rm.train.state_digest): rows swapped within
    or between tables change it, and a restore must give back what was saved bit for bit. The numbers
    (`checksum_value` of the embeddings, `optim_value`, `dense_value`: sums of value + value squared) are
    for comparisons with a run at another world size, equal up to float reassociation. Collective: every
    rank at the same step; replicated tensors are counted once (rank 0's)."""
    sums, digests = checksum_part(dmp, dense_opt)
    dist.all_reduce(sums)
    dist.all_reduce(digests)  # int64 sums wrap: exact in any order
    values = [float(v) for v in sums]
    named = dict(zip(("checksum_value", "optim_value", "dense_value"), values, strict=True))
    return {**named, "checksum": digest_hex(digests)}


def file_writers(restored: RestoreResult) -> dict[str, list[str | None]]:
    """Each file this rank restored from -> [the node that wrote it, where it was read]. The files of a
    differential chain's base and deltas ("<step>/<name>") are not in the restored step's manifest: their
    writer is the node of the rank in their name (a chain is saved by one world)."""
    nodes = restored.manifest.get("nodes") or []
    out: dict[str, list[str | None]] = {}
    for f, src in restored.file_sources.items():
        writer = restored.manifest["files"].get(f, {}).get("node")
        m = re.match(r"__(\d+)_", f.rsplit("/", 1)[-1])
        if writer is None and m and int(m[1]) < len(nodes):
            writer = nodes[int(m[1])]
        out[f] = [writer, src]
    return out


def main() -> None:
    args = parse_args()
    if not args.in_place:
        prepared = prepare(args)  # before the process group: nothing of it needs one
        dist.init_process_group("gloo")
        train(args, in_place=None, times={"group": time.time()}, prepared=prepared)
    else:  # rounds in place: a drained round ends the body, and the next round runs it again
        ended: dict[str, float] = {}  # when the previous round's body and cleanup ended (profiles)
        # prepare: each round's model and sharding plan are built before its process group, while the
        # group's initialisation would wait for the slowest rank (a joining node's new worker)
        for rnd in rounds(get_reporter(sync_every=5), prepare=lambda: prepare(args)):
            if rnd.in_place and rnd.rank == args.raise_in_place_on_rank:
                raise RuntimeError(f"--raise-in-place-on-rank {rnd.rank}: failing the in-place round")
            finished = False
            with rnd:  # a collective that fails (a member was lost): wait for the next round in place
                finished = train(
                    args, in_place=rnd, times={**ended, **rnd.times}, prepared=rnd.take_prepared()
                )
            ended = {"body_ended": time.time()}
            gc.collect()  # the old round's DMP and groups are garbage before the groups are destroyed
            ended["collected"] = time.time()
            if finished:
                break
    gc.collect()  # before destroy: gloo aborts at exit about 1 run in 8 otherwise
    dist.destroy_process_group()


Prepared = tuple[DLRMTrain, list[EmbeddingBagConfig], ShardingPlan, dict[str, float]]


def prepare(args: argparse.Namespace) -> Prepared:
    """The unsharded model (embedding tables on the meta device) with its fused sparse optimizer and
    its sharding plan for this world (``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``), and when each was done.
    Needs no process group: the ranks check that their plans agree once it is up (in train)."""
    torch.manual_seed(args.seed)  # the dense layers' initial weights: the same in every run and world size
    model, tables = build_model(args)
    apply_optimizer_in_backward(
        trec_optim.RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": args.lr}
    )
    built = time.time()
    # GreedyProposer alone: the same plan as TorchRec's default proposers for this model at every world
    # size (checked in tests/train), in a third of the time; the plan is made again at every round
    plan = plan_sharding(
        model, WorldTopology.from_env(), check_same_on_all_ranks=False, proposer=GreedyProposer()
    )
    return model, tables, plan, {"built": built, "planned": time.time()}


def train(
    args: argparse.Namespace,
    in_place: Round | None,
    times: dict[str, float],
    prepared: Prepared | None = None,
) -> bool:
    """One round: build (or take the ``prepared`` model and plan), restore, train until done (True) or
    drained (False). ``times``: when this round's process group came up (and, in place, when the old round
    stopped); the "start" row gets them with the phases below, as wall-clock times
    (benchmarks/recovery/breakdown.py reads them)."""
    phases = {"imported": IMPORTED_AT, **times} if in_place is None or not in_place.in_place else dict(times)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:  # every world --nnodes allows, from the first round on
        check_global_batch(args.global_batch, world)
    except ValueError as exc:
        raise SystemExit(f"--global-batch: {exc}") from None
    local_batch = args.global_batch // world
    model, tables, plan, prepared_at = prepared or prepare(args)
    phases.update(prepared_at)
    check_plan_agreement(plan)  # every rank computed the same plan (a digest all-gather)
    phases["agreed"] = time.time()
    dmp = wrap_model(model, plan)
    dense_opt = torch.optim.Adagrad([p for _, p in dense_parameters(dmp)], lr=args.lr)
    phases["wrapped"] = time.time()
    node = os.environ.get("ERM_NODE_ID") or os.environ.get("GROUP_RANK", "0")
    # replicate: every node's shards are also kept in one peer node's memory, so that losing a node (SIGKILL,
    # a dead machine) loses nothing; the durable directory (if any) is the copy of last resort.
    # node_id: this node's memory directory; under torchrun, several agents on one host must not share one.
    ckpt_cfg = FlashConfig(
        node_id=node,
        durable_dir=Path(args.checkpoint_dir) if args.checkpoint_dir else None,
        persist_every=args.persist_every,
        replicate=True,
        differential=args.differential,
    )
    ckpt = FlashCheckpointer(dmp, plan, dense_opt, ckpt_cfg)
    restored = ckpt.restore()
    step = restored.step if restored else 0
    if restored is None:
        init_tables(dmp, tables, args.seed)
    phases["restored"] = time.time()
    data = SyntheticClickData(
        num_samples=10_000_000, vocab_sizes=args.rows, seed=args.seed, zipf_exponent=args.zipf
    )
    range_size = args.range_steps * args.global_batch
    if restored is not None and "ledger" in restored.position:
        ledger = RangeLedger.from_checkpoint(restored.position["ledger"])
    else:
        ledger = RangeLedger((data.num_samples // range_size) * range_size, range_size)  # drop_last
    batches = GlobalBatches(ledger, args.global_batch)
    if restored is not None and "ledger" not in restored.position:
        for _ in range(step):  # a checkpoint from before the ledger: step s held the s-th global batch
            batches.next()
            batches.consumed()
    features = [f"cat_{i}" for i in range(args.tables)]
    progress = None
    if args.progress_dir:
        os.makedirs(args.progress_dir, exist_ok=True)
        progress = open(
            os.path.join(args.progress_dir, f"{node}-{os.environ.get('LOCAL_RANK', '0')}.jsonl"), "a"
        )

    def emit(**fields: object) -> None:
        if progress is not None:
            row = {"t": time.time(), "node": node, "rank": rank, "world": world, "pid": os.getpid(), **fields}
            progress.write(json.dumps(row) + "\n")
            progress.flush()

    checksum = state_checksum(dmp, dense_opt)
    phases["checksum"] = time.time()
    emit(
        start=True,
        phases=phases,
        in_place=in_place is not None and in_place.in_place,
        restored_step=step if restored else None,
        nodes=ckpt.rank_nodes,  # this world's node per rank; saved_by: the checkpoint's
        saved_by=restored.manifest.get("nodes") if restored else None,
        # where this rank read each file from, with the node that wrote it (demo checks: after a loss,
        # the lost node's files must come from a peer's memory)
        restore_files=file_writers(restored) if restored else None,
        ledger_samples_done=batches.ledger.samples_done(),
        epoch_samples=batches.ledger.num_samples,
        **checksum,
    )
    reporter = get_reporter(sync_every=5)
    last_save: dict[str, int | None] = {"step": None}  # the step of the last save started (any kind)

    @reporter.on_stop
    def drained(done: int) -> None:  # every rank stops at this same step (sync_every): collectives are fine
        # done: the reporter's global step (it counts on from the restored checkpoint's step)
        hook_at = time.time()
        if last_save["step"] == done:  # this step's periodic save is in flight: the same state
            ckpt.wait()  # (saving it again waited for it, then wrote it twice: 0.6 s more in a swap)
        else:
            ckpt.save(done, position(), block=True)
            last_save["step"] = done
        saved_at = time.time()
        save_phases = {f"save_{k}": t for k, t in ckpt.last_phases.items()}  # where the save's time went
        # this rank's part of the drained state's checksum, not the collective total: with a total, the
        # kept ranks would wait here for a throttled straggler's share before their drain is done (the
        # checks add every rank's part: elastic_rm.demo.checks.drained_checksum)
        _, digests = checksum_part(dmp, dense_opt)
        emit(
            drained_step=done,
            phases={"hook": hook_at, **save_phases, "saved": saved_at},
            checksum_part=[int(v) for v in digests],
        )

    def position() -> dict:
        return {"step": step, "ledger": batches.ledger.checkpoint_state()}

    stop_file = os.path.join(args.progress_dir, "stop") if args.progress_dir else None
    paced_at = time.monotonic() - step / args.pace if args.pace > 0 else 0.0
    reporter.reset_timer()  # the first step's time starts here, not at the build or the restore
    finished = True
    committed = step if restored else None
    while not (args.steps and step >= args.steps):
        lo, hi = batches.next()  # this step's global batch; this rank takes its slice
        start = lo + rank * local_batch
        batch = data.batch(start, start + local_batch)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=features,
            values=batch.sparse[:, : args.tables].t().contiguous().view(-1),
            lengths=torch.ones(args.tables * local_batch, dtype=torch.int64),
        )
        from torchrec.datasets.utils import Batch

        loss, _ = dmp(Batch(dense_features=batch.dense, sparse_features=kjt, labels=batch.labels))
        dense_opt.zero_grad()
        loss.backward()  # DLRMTrain's loss is the mean over the local batch: a global mean after averaging
        dense_opt.step()
        batches.consumed()  # the batch is in the model: the ledger marks it
        step += 1
        if args.checkpoint_every == 1 and last_save["step"] == step - 1:
            # a step counts as done once the previous step's checkpoint is committed on every node, every
            # replica push of it included (gathered by the save). No pause of its own: this step's save
            # waits for that one anyway (with rarer saves, waiting here would hold the step after each
            # save for the whole background of it)
            failed = ckpt.wait()
            if failed:  # not done: a lost node could now cost more than the docs promise
                raise RuntimeError(
                    f"step {step - 1}: replica push failed ({'; '.join(failed)}); with --checkpoint-every 1 "
                    "a step counts only once its checkpoint is on every node and its ring peer: this round "
                    "stops and the job resumes from its newest checkpoint"
                )
        emit(
            step=step,
            samples=local_batch,
            loss=float(loss.detach()),
            epoch=batches.ledger.epoch,
            sample_start=lo,
            sample_end=hi,
        )
        if step == args.raise_at_step and rank == 1 and restored is None:
            raise RuntimeError(f"--raise-at-step {step}: a failure that is no member's loss")
        if args.checksum_every and step % args.checksum_every == 0:
            emit(checksum_step=step, **state_checksum(dmp, dense_opt))
        if step % args.checkpoint_every == 0:
            ckpt.save(step, position())
            last_save["step"] = step
        if ckpt.replicated_everywhere is not None and ckpt.replicated_everywhere != committed:
            committed = ckpt.replicated_everywhere  # in every node's memory, every replica push included
            emit(committed_step=committed)
        if args.pace > 0:  # sleep off the rest of the step's share of time (sleeping is not busy time)
            time.sleep(max(0.0, paced_at + step / args.pace - time.monotonic()))
        stop_now = reporter.step(samples=local_batch)
        if stop_now:
            finished = False
            break
        if stop_file and step % 5 == 0:
            flag = torch.tensor([1.0 if os.path.exists(stop_file) else 0.0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
    if finished or in_place is None:  # drained in place: the drain's checkpoint is the round's last
        if last_save["step"] == step:
            ckpt.wait()  # this step's save (periodic, or the drain's) is the final one
        else:
            ckpt.save(step, position(), block=True)
        emit(
            end=True,
            final_step=step,
            ledger_samples_done=batches.ledger.samples_done(),
            **state_checksum(dmp, dense_opt),
        )
    ckpt.close(finished=finished)  # a finished job's node memory is freed (plain torchrun too)
    if progress is not None:
        progress.close()
    return finished


if __name__ == "__main__":
    main()
