"""One rank of the differential-checkpoint benchmark (started by `python -m benchmarks.delta`).

Phase "train" (world 2): a DLRM with fused row-wise Adagrad on power-law (Zipf) ids trains without
checkpoints (the throughput baseline), then with a flash checkpoint every 1, 10 and 100 steps, in the
mode of this launch (full copies, or differential); then one save alone (its background time).
Full mode: the newest step is restored at the same world. Differential mode: after each interval's
timed run, that interval's own chain (a new base, then a save every interval) is restored once it holds
CHAIN_DELTAS deltas, or said to fold before; at the end, a heavy case, a chain of all three intervals
near its fold. Each chain is compared with a full save of the same step, restored in the same
conditions; both are staged on disk. Phase "restore" (world 3): the same restores into another plan.
Each restore is timed five times, the median kept; every one is checked bit for bit against the
state digest saved with it.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import resource
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torchrec.optim as trec_optim
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from elastic_rm.checkpoint.collectives import all_gather_json
from elastic_rm.checkpoint.manifest import MANIFEST, committed_steps, step_dirname
from elastic_rm.checkpoint.peers import PEERS_ENV
from elastic_rm.checkpoint.snapshot import local_pieces
from elastic_rm.train import (
    FlashCheckpointer,
    FlashConfig,
    SyntheticClickData,
    WorldTopology,
    dense_parameters,
    plan_sharding,
    wrap_model,
)
from elastic_rm.train.state_digest import digest_hex, piece_digest

FILL_ROWS = 1 << 16

RESTORES = 5  # restores timed at each world; their median is quoted (one restore moves with the load)
CHAIN_DELTAS = 10  # a chain restore is measured once a chain holds this many deltas
MIXED_LONG_MAX = 12  # at most this many 100-step deltas in the mixed chain (a fold comes before)


def build(spec: dict[str, Any], world: int) -> tuple[Any, Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=spec["dim"], num_embeddings=spec["rows"], feature_names=[f"cat_{i}"]
        )
        for i in range(spec["tables"])
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=[64, spec["dim"]],
            over_arch_layer_sizes=[64, 1],
            dense_device=torch.device("cpu"),
        )
    )
    apply_optimizer_in_backward(trec_optim.RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.02})
    plan = plan_sharding(model, WorldTopology(world, world))
    dmp = wrap_model(model, plan)
    dense_opt = torch.optim.Adagrad([p for _, p in dense_parameters(dmp)], lr=0.02)
    return dmp, plan, dense_opt


@torch.no_grad()
def fill_tables(dmp: Any) -> None:
    """Deterministic rows (a function of table, row and column), whatever the sharding."""
    for key, value in dmp.state_dict().items():
        if "embedding_bags" not in key:
            continue
        salt = sum(map(ord, key))
        for off, t in local_pieces(value):
            for lo in range(0, t.shape[0], FILL_ROWS):
                hi = min(lo + FILL_ROWS, t.shape[0])
                r = torch.arange(off[0] + lo, off[0] + hi, dtype=torch.int64)[:, None]
                c = torch.arange(off[1], off[1] + t.shape[1], dtype=torch.int64)[None, :]
                t[lo:hi].copy_((((r * 131 + c * 7 + salt) % 1009) - 504).to(torch.float32) * 1e-4)


def state_digest(dmp: Any, dense_opt: torch.optim.Optimizer) -> str:
    """The whole training state's exact digest (embeddings, fused and dense optimizer state, dense
    weights), the same at any world size. Collective."""
    total = torch.zeros(1, dtype=torch.int64)
    rank = dist.get_rank()

    def add(name: str, value: Any) -> None:
        if not isinstance(value, torch.Tensor):
            return
        if "ShardedTensor" not in type(value).__name__ and rank != 0:
            return  # replicated: rank 0's copy counts
        for off, t in local_pieces(value):
            total.add_(piece_digest(name, off, t))

    for key, value in dmp.state_dict().items():
        add(key, value)
    for param, per in dmp.fused_optimizer.state_dict()["state"].items():
        for name, value in per.items():
            add(f"{param}/{name}", value)
    for g, group in enumerate(dense_opt.param_groups):
        for n, p in enumerate(group["params"]):
            for name, value in dense_opt.state.get(p, {}).items():
                add(f"dense/{g}/{n}/{name}", value)
    dist.all_reduce(total)
    return digest_hex(total)


class Trainer:
    def __init__(self, spec: dict[str, Any], dmp: Any, dense_opt: torch.optim.Optimizer) -> None:
        self.spec, self.dmp, self.dense_opt = spec, dmp, dense_opt
        self.data = SyntheticClickData(
            100_000_000, spec["rows"], seed=1, num_sparse=spec["tables"], zipf_exponent=spec["zipf"]
        )
        self.features = [f"cat_{i}" for i in range(spec["tables"])]
        self.step = 0
        self.local = spec["global_batch"] // dist.get_world_size()

    def batch_range(self, step: int) -> tuple[int, int]:
        lo = step * self.spec["global_batch"] + dist.get_rank() * self.local
        return lo, lo + self.local

    def train_step(self) -> None:
        b = self.data.batch(*self.batch_range(self.step))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=self.features,
            values=b.sparse.t().contiguous().view(-1),
            lengths=torch.ones(len(self.features) * len(b), dtype=torch.int64),
        )
        loss, _ = self.dmp(Batch(dense_features=b.dense, sparse_features=kjt, labels=b.labels))
        self.dense_opt.zero_grad()
        loss.backward()
        self.dense_opt.step()
        self.step += 1


def touched_fraction(spec: dict[str, Any], first: int, steps: int, interval: int) -> dict[str, float]:
    """Rows looked up (so updated by the fused optimizer, weights and state) per window of `interval`
    steps of the global batches [first, first + steps), as a share of all rows: mean and max."""
    data = SyntheticClickData(
        100_000_000, spec["rows"], seed=1, num_sparse=spec["tables"], zipf_exponent=spec["zipf"]
    )
    gb, rows = spec["global_batch"], spec["rows"] * spec["tables"]
    shares = []
    for w in range(first, first + steps - interval + 1, interval):
        ids = data.raw(np.arange(w * gb, (w + interval) * gb))[1]
        shares.append(sum(np.unique(ids[:, t]).size for t in range(ids.shape[1])) / rows)
    return {"mean": float(np.mean(shares)), "max": float(np.max(shares)), "windows": len(shares)}


def slowest(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def total(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)


def shm_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


def step_bytes(node_dir: Path, step: int, node: str) -> dict[str, int] | None:
    """(written: every file of the step; replicated: this node's files and the shared ones) from the
    step's manifest in this node's memory, or None once pruned."""
    try:
        m = json.loads((node_dir / step_dirname(step) / MANIFEST).read_bytes())
    except OSError:
        return None
    files = m["files"]
    return {
        "kind": m.get("kind", "full"),
        "written": sum(e["size"] for e in files.values()),
        "replicated": sum(e["size"] for e in files.values() if e.get("node") in (node, "*")),
    }


def chain_shape(ckpt: FlashCheckpointer) -> dict[str, Any]:
    """The chain of the newest step in node memory, from rank 0's manifests (each lists every node's
    files): its deltas, their bytes over the base's, and the same for the node whose deltas are the
    largest share of its own files of the base (the fold's bound is each node's)."""
    shape = None
    if ckpt.rank == 0:

        def manifest(step: int) -> dict[str, Any]:
            return json.loads((ckpt.node_dir / step_dirname(step) / MANIFEST).read_bytes())

        links = [manifest(max(committed_steps(ckpt.node_dir)))]
        while links[0].get("kind") == "delta":
            links.insert(0, manifest(links[0]["parent"]))

        def size(m: dict[str, Any], node: str | None = None) -> int:
            return sum(e["size"] for e in m["files"].values() if node is None or e["node"] in (node, "*"))

        nodes = sorted({e["node"] for e in links[0]["files"].values()} - {"*"})
        shape = {
            "step": links[-1]["step"],
            "base_step": links[0]["step"],
            "deltas": len(links) - 1,
            "bytes_over_base": sum(size(m) for m in links[1:]) / size(links[0]),
            "node_bytes_over_base_max": max(
                sum(size(m, n) for m in links[1:]) / size(links[0], n) for n in nodes
            ),
        }
    return all_gather_json(shape)[0]


def clear_node_memory(ckpt: FlashCheckpointer) -> None:
    """Empty this node's memory directory (its steps and the replicas it keeps; collective): the next
    save, a full one, is then not written beside a chain, so node memory stays what training holds."""
    if ckpt.leader:
        for p in ckpt.node_dir.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    dist.barrier()


def stage(ckpt: FlashCheckpointer, dest: Path) -> None:
    """Copy this node's memory directory to `dest`/<node> on disk (collective), for the restore into
    world 3 (phase "restore" copies it back into node memory first)."""
    if ckpt.leader:
        shutil.copytree(ckpt.node_dir, dest / ckpt.node, ignore=shutil.ignore_patterns("fetch"))
    dist.barrier()


def base_now(tr: Trainer, ckpt: FlashCheckpointer) -> None:
    """A full save of the current step with nothing else in node memory: a new base. The step is saved
    as a delta first when it is not the newest saved one (a step saved again is a full save)."""
    if ckpt.last_committed != tr.step:
        ckpt.save(tr.step, {"step": tr.step}, block=True)
    clear_node_memory(ckpt)
    stats = ckpt.save(tr.step, {"step": tr.step}, block=True)
    assert stats.kind == "full", stats


def zero_state(dmp: Any) -> None:
    """Every local piece of the model's state zeroed: a restore that left anything out cannot pass the
    digest check by what the previous restore left there."""
    with torch.no_grad():
        for v in dmp.state_dict().values():
            if isinstance(v, torch.Tensor):
                for _, t in local_pieces(v):
                    t.zero_()


def timed_restores(ckpt: FlashCheckpointer, dmp: Any, dense_opt: Any, digest: str) -> dict[str, Any]:
    """RESTORES restores at this world, each into a model whose tables are zeroed first (so nothing
    stale can pass), each checked bit for bit against `digest`; their median is quoted (one restore
    moves with the machine's load)."""
    runs = repeated_restores(ckpt, dmp, dense_opt)
    return {
        "s": float(np.median(runs["times"])),
        "all_s": runs["times"],
        "parts_s": median_parts(runs["parts"]),
        "step": one_or_all(runs["steps"]),
        "exact": all(d == digest for d in runs["digests"]),
    }


def repeated_restores(ckpt: FlashCheckpointer, dmp: Any, dense_opt: Any) -> dict[str, Any]:
    """RESTORES restores, each into a model whose state is zeroed first: each one's time (its slowest
    rank), step, parts (restore_parts) and the digest of the state it left; the last one's sources."""
    runs: dict[str, Any] = {"times": [], "steps": [], "parts": [], "digests": []}
    got = None
    for _ in range(RESTORES):
        zero_state(dmp)
        dist.barrier()
        t0 = time.perf_counter()
        got = ckpt.restore()
        runs["times"].append(slowest(time.perf_counter() - t0))
        runs["steps"].append(got.step if got else None)
        runs["parts"].append(restore_parts(got))
        runs["digests"].append(state_digest(dmp, dense_opt))
    runs["sources"] = sorted(set(got.file_sources.values())) if got else []
    return runs


def one_or_all(values: list) -> Any:
    """The value when every restore gave the same, else all of them (for the reader to see which)."""
    return values[-1] if len(set(values)) == 1 else values


def restore_parts(got: Any) -> dict[str, float]:
    """Where a restore's time went, each part on its slowest rank (RestoreResult): the delta files
    read and verified (while the base loads) and the wait for them after the base, the base loaded
    through DCP, the deltas' rows applied."""
    keys = ("deltas_s", "deltas_wait_s", "base_s", "apply_s")
    return {k: slowest(getattr(got, k) if got else 0.0) for k in keys}


def median_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.median([p[k] for p in parts])) for k in parts[0]} if parts else {}


def measure_chain(tr: Trainer, ckpt: FlashCheckpointer, spec: dict[str, Any], label: str) -> dict[str, Any]:
    """The chain of the newest step restored at this world, then the same step saved in full (the
    chain first removed from node memory) and restored: the same state from a chain and from a full
    snapshot, in the same conditions. Both are staged on disk for the restores into world 3."""
    out = chain_shape(ckpt)
    out["digest"] = state_digest(tr.dmp, tr.dense_opt)
    out["restore_chain"] = timed_restores(ckpt, tr.dmp, tr.dense_opt, out["digest"])
    where = Path(spec["workdir"]) / "stage" / label
    stage(ckpt, where / "chain")
    base_now(tr, ckpt)
    out["restore_full"] = timed_restores(ckpt, tr.dmp, tr.dense_opt, out["digest"])
    stage(ckpt, where / "full")
    out["chain_over_full"] = out["restore_chain"]["s"] / out["restore_full"]["s"]
    return out


def own_chain(tr: Trainer, ckpt: FlashCheckpointer, spec: dict[str, Any], interval: int) -> dict[str, Any]:
    """The chain of one checkpoint interval alone: a new base, then a save every `interval` steps until
    the chain holds CHAIN_DELTAS deltas (then measured, measure_chain) or a save folds it first (then
    the chain before the fold is said, and no restore is measured: the interval never holds such a
    chain). These steps are not timed."""
    base_now(tr, ckpt)
    shape = chain_shape(ckpt)
    for _ in range(CHAIN_DELTAS):
        for _ in range(interval):
            tr.train_step()
        stats = ckpt.save(tr.step, {"step": tr.step}, block=True)
        if stats.kind != "delta":
            return {"interval": interval, "folds_before": CHAIN_DELTAS, "before_fold": shape}
        shape = chain_shape(ckpt)
    return {"interval": interval, **measure_chain(tr, ckpt, spec, f"every_{interval}")}


def mixed_chain(tr: Trainer, ckpt: FlashCheckpointer, spec: dict[str, Any]) -> dict[str, Any]:
    """A heavy case: a chain of all three intervals near its fold. A new base, 9 deltas of 1
    step, 6 of 10 steps, then deltas of 100 steps while the next one (as large as the last) would stay
    within the fold's bound; measured as measure_chain."""
    base_now(tr, ckpt)
    plan: list[int] = []
    for interval in [1] * 9 + [10] * 6:
        before = chain_shape(ckpt)
        for _ in range(interval):
            tr.train_step()
        if ckpt.save(tr.step, {"step": tr.step}, block=True).kind != "delta":
            return {"delta_intervals": plan, "folds_before": len(plan) + 1, "before_fold": before}
        plan.append(interval)
    shape, grew = chain_shape(ckpt), 0.0
    for _ in range(MIXED_LONG_MAX):
        # the next one would fold (compact_ratio 1), with a margin: deltas of 100 steps vary a little
        if shape["node_bytes_over_base_max"] + 1.1 * grew > 1.0:
            break
        for _ in range(100):
            tr.train_step()
        stats = ckpt.save(tr.step, {"step": tr.step}, block=True)
        if stats.kind != "delta":  # the bound came sooner than the last delta's size said
            return {"delta_intervals": plan, "folds_before": len(plan) + 1, "before_fold": shape}
        plan.append(100)
        after = chain_shape(ckpt)
        grew, shape = after["node_bytes_over_base_max"] - shape["node_bytes_over_base_max"], after
    return {"delta_intervals": plan, **measure_chain(tr, ckpt, spec, "mixed")}


def cpu_s(server_pid: int | None) -> tuple[float, float]:
    """CPU seconds used so far by this rank (every thread: training and the checkpoint's background) and
    by its node's checkpoint server process (0 without one)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    server = 0.0
    if server_pid is not None:
        try:
            fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
            server = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
            server = 0.0
    return me.ru_utime + me.ru_stime, server


def run_interval(
    tr: Trainer, ckpt: FlashCheckpointer | None, interval: int, steps: int, server_pid: int | None = None
) -> dict[str, Any]:
    """`steps` training steps with a save every `interval` (none without a checkpointer): the loop's
    wall time, each save's pause and stats; after the loop, the node memory (the node directory's
    bytes then, and the checkpointer's peak so far, sampled by it before its publishes: the timed loop
    does not walk the directory). A save before the loop, waited for, sets the steady state: the
    loop's first save has a committed predecessor to extend."""
    node_dir = ckpt.node_dir if ckpt is not None else None
    saves: list[dict[str, Any]] = []
    held_end = 0
    if ckpt is not None:  # steady state: the timed loop starts after a committed save (a delta's base)
        tr.train_step()  # a step of its own: a save's step must be newer than the last one
        ckpt.save(tr.step, {"step": tr.step})
        ckpt.wait()
    first = tr.step
    dist.barrier()
    cpu0 = cpu_s(server_pid)
    parts0 = dict(ckpt.cpu_seconds) if ckpt is not None else {}
    t0 = time.perf_counter()
    for _ in range(steps):
        tr.train_step()
        if ckpt is not None and (tr.step - first) % interval == 0:  # every save covers `interval` steps
            stats = ckpt.save(tr.step, {"step": tr.step})
            row = {k: v for k, v in vars(stats).items() if isinstance(v, int | float | str | list)}
            saves.append(row)
    loop_s = time.perf_counter() - t0
    if ckpt is not None:
        ckpt.wait()
    cpu1 = cpu_s(server_pid)  # after the last save's background work: its CPU belongs to these steps
    if ckpt is not None and ckpt.leader and node_dir is not None:
        held_end = shm_bytes(node_dir)
    out: dict[str, Any] = {"interval": interval, "steps": steps, "first_step": first}
    # CPU per step over all ranks and their nodes' checkpoint servers (a figure the machine's load moves
    # less than a time: what the checkpoint takes from training where no core is idle)
    out["cpu_ms_per_step"] = {
        "ranks": 1e3 * total(cpu1[0] - cpu0[0]) / steps,
        "servers": 1e3 * total(cpu1[1] - cpu0[1]) / steps,
    }
    out["loop_s"] = slowest(loop_s)
    out["steps_per_s"] = steps / out["loop_s"]
    if ckpt is None:
        return out
    pauses = [s["pause_s"] for s in saves]
    out["saves"] = len(saves)
    # the saves' CPU on the ranks by part (the checkpointer's thread CPU time), over both ranks, per step
    out["checkpoint_cpu_ms_per_step_by_part"] = {
        part: 1e3 * total(ckpt.cpu_seconds[part] - parts0[part]) / steps for part in sorted(parts0)
    }
    out["pause_median_s"] = slowest(float(np.median(pauses)))
    out["pause_max_s"] = slowest(float(np.max(pauses)))
    out["waited_max_s"] = slowest(float(np.max([s["waited_s"] for s in saves])))  # for the previous save
    copied = [s.get("bytes_copied", s["bytes"]) for s in saves]
    out["bytes_copied_mean"] = total(float(np.mean(copied)))
    out["kinds"] = sorted({s.get("kind", "full") for s in saves})
    out["kind_counts"] = dict(Counter(s.get("kind", "full") for s in saves))
    per_step = []
    for s in saves:
        got = step_bytes(node_dir, s["step"], ckpt.node) if ckpt.leader else None
        per_step.append(got)
    kept = [p for p in per_step if p is not None]
    gathered = all_gather_json(
        {"kept": kept, "held_end": held_end, "peak": ckpt.memory_peak_bytes, "saves": saves}
    )
    leaders = [g for g in gathered if g["kept"]]
    if leaders:  # every node's share: written is the whole step (the same manifest on each node)
        deltas = [p for p in leaders[0]["kept"] if p["kind"] == "delta"] or leaders[0]["kept"]
        out["bytes_written_mean"] = float(np.mean([p["written"] for p in deltas]))
        out["bytes_replicated_mean"] = float(
            sum(
                np.mean([p["replicated"] for p in g["kept"] if p["kind"] == deltas[0]["kind"]])
                for g in leaders
            )
        )
        out["steps_measured_for_bytes"] = len(deltas)
    out["node_memory_end_bytes"] = max(g["held_end"] for g in gathered)
    out["node_memory_peak_bytes"] = max(g["peak"] for g in gathered)  # since the checkpointer's start
    out["save_stats_rank0"] = saves[:3] + saves[-2:] if len(saves) > 5 else saves
    return out


def phase_train(spec: dict[str, Any], rank: int) -> dict[str, Any]:
    dmp, plan, dense_opt = build(spec, 2)
    fill_tables(dmp)
    res: dict[str, Any] = {"mode": spec["mode"]}
    res["state_bytes"] = total(
        sum(
            t.numel() * t.element_size()
            for v in list(dmp.state_dict().values())
            + [x for per in dmp.fused_optimizer.state_dict()["state"].values() for x in per.values()]
            if isinstance(v, torch.Tensor)
            for _, t in local_pieces(v)
        )
    )
    tr = Trainer(spec, dmp, dense_opt)
    for _ in range(spec["warmup_steps"]):
        tr.train_step()
    server_pid = spec.get("server_pids", {}).get(f"n{rank}")
    res["no_checkpoint"] = run_interval(tr, None, 1, spec["baseline_steps"], server_pid)
    extra = {"differential": True} if spec["mode"] == "delta" else {}
    cfg = FlashConfig(
        run_id="bench",
        node_id=f"n{rank}",
        memory_root=Path(spec["shm"]),
        keep_memory=1,
        replicate=True,
        **extra,
    )
    ckpt = FlashCheckpointer(dmp, plan, dense_opt, cfg)
    res["prepare_s"] = slowest(ckpt.prepare())
    runs = []
    for interval, steps in spec["intervals"]:
        if rank == 0:
            print(f"[{spec['mode']}] checkpoint every {interval} steps, {steps} steps", flush=True)
        # the baseline next to it: the same number of steps without saves, right before (the machine's
        # load moves; in the differential mode the tracker records the ids meanwhile, as it does when
        # checkpoints are rare, and the settle save of run_interval takes them)
        # the every-step run alternates shorter blocks with and without saves (the machine's load moves
        # between two long blocks): its ratio is the median of the pairs'
        blocks = spec.get("every_step_blocks", 1) if interval == 1 else 1
        pairs = []
        for _ in range(blocks):
            plain = run_interval(tr, None, interval, steps // blocks, server_pid)
            pairs.append((plain, run_interval(tr, ckpt, interval, steps // blocks, server_pid)))
        # each block's own figures: a block that holds a fold (a new base written) costs more
        blocks_out = [
            {
                "throughput_ratio": c["steps_per_s"] / plain["steps_per_s"],
                "kind_counts": c["kind_counts"],
                "checkpoint_cpu_ms_per_step": sum(c["cpu_ms_per_step"].values())
                - sum(plain["cpu_ms_per_step"].values()),
                "servers_cpu_ms_per_step": c["cpu_ms_per_step"]["servers"],
                "checkpoint_cpu_ms_per_step_by_part": c["checkpoint_cpu_ms_per_step_by_part"],
            }
            for plain, c in pairs
        ]
        run = pairs[-1][1]  # bytes, pauses and memory: the last block's
        run["blocks"] = blocks_out
        run["touched"] = (
            touched_fraction(spec, run["first_step"], run["steps"], interval) if rank == 0 else None
        )
        ratios = [c["steps_per_s"] / p["steps_per_s"] for p, c in pairs]
        run["no_checkpoint_steps_per_s"] = sum(p["steps"] for p, _ in pairs) / sum(
            p["loop_s"] for p, _ in pairs
        )
        run["steps_per_s"] = sum(c["steps"] for _, c in pairs) / sum(c["loop_s"] for _, c in pairs)
        run["throughput_ratios"] = ratios
        for side, i in (("no_checkpoint_cpu_ms_per_step", 0), ("cpu_ms_per_step", 1)):
            run[side] = {
                who: float(np.mean([pair[i]["cpu_ms_per_step"][who] for pair in pairs]))
                for who in ("ranks", "servers")
            }
        run["checkpoint_cpu_ms_per_step_by_part"] = {
            part: float(np.mean([c["checkpoint_cpu_ms_per_step_by_part"][part] for _, c in pairs]))
            for part in run["checkpoint_cpu_ms_per_step_by_part"]
        }
        # what the saves cost in CPU per training step, over both ranks and both checkpoint servers
        run["checkpoint_cpu_ms_per_step"] = sum(run["cpu_ms_per_step"].values()) - sum(
            run["no_checkpoint_cpu_ms_per_step"].values()
        )
        run["throughput_ratio"] = float(np.median(ratios))
        runs.append(run)
        if spec["mode"] == "delta":  # this interval's own chain, restored (not timed with the above)
            res.setdefault("chains", {})[f"every_{interval}"] = own_chain(tr, ckpt, spec, interval)
    res["intervals"] = runs
    # one save alone: its pause and the background time until every copy is committed
    for _ in range(spec["alone_gap_steps"]):
        tr.train_step()
    dist.barrier()
    t0 = time.perf_counter()
    stats = ckpt.save(tr.step, {"step": tr.step})
    ckpt.wait()
    res["alone"] = {
        "step": tr.step,
        "kind": getattr(stats, "kind", "full"),
        "pause_s": slowest(stats.pause_s),
        "background_s": slowest(time.perf_counter() - t0),
        "bytes_copied": total(getattr(stats, "bytes_copied", stats.bytes)),
    }
    if spec["mode"] == "delta":  # a heavy case: a chain of every interval, near its fold
        res["chains"]["mixed"] = mixed_chain(tr, ckpt, spec)
    # the node directory's bytes at their largest over the whole run (own steps, replicas, temp dirs)
    res["node_memory_peak_bytes"] = max(all_gather_json(ckpt.memory_peak_bytes))
    if spec["mode"] == "full":  # the newest step restored at the same world (and into world 3 next)
        res["saved_step"] = tr.step
        res["saved_digest"] = state_digest(dmp, dense_opt)
        got = timed_restores(ckpt, dmp, dense_opt, res["saved_digest"])
        res["restore_same_world_s"] = got["s"]
        res["restore_same_world_all_s"] = got["all_s"]
        res["restore_same_world_step"] = got["step"]
        res["restore_same_world_exact"] = got["exact"]
    res["max_rss_gib"] = slowest(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    ckpt.close()
    return res


def restore_in(spec: dict[str, Any], rank: int, world: int, dmp: Any, plan: Any, dense_opt: Any) -> dict:
    """RESTORES restores of what node memory holds now into this world's plan; the caller checks the
    digest against the saved one (every restore must give that same state)."""
    cfg = FlashConfig(run_id="bench", node_id=f"n{rank}", memory_root=Path(spec["shm"]), keep_memory=1)
    ckpt = FlashCheckpointer(dmp, plan, dense_opt, cfg)
    runs = repeated_restores(ckpt, dmp, dense_opt)
    times = runs["times"]
    res: dict[str, Any] = {"world": world, "restore_s": float(np.median(times)), "restore_all_s": times}
    res["parts_s"] = median_parts(runs["parts"])
    res["step"] = one_or_all(runs["steps"])
    res["digest"] = one_or_all(runs["digests"])
    res["sources"] = runs["sources"]
    ckpt.close()
    return res


def phase_restore(spec: dict[str, Any], rank: int, world: int) -> dict[str, Any]:
    """Full mode: the train phase's newest step. Differential mode: each chain the train phase staged
    on disk, and the full step of the same state beside it, each copied into the nodes' memory first
    (the new node's memory empty), as the train phase's nodes held it."""
    dmp, plan, dense_opt = build(spec, world)
    if spec["mode"] == "full":
        return restore_in(spec, rank, world, dmp, plan, dense_opt)
    staged = Path(spec["workdir"]) / "stage"
    shm = Path(spec["shm"])
    res: dict[str, Any] = {"world": world, "chains": {}}
    for label in sorted(p.name for p in staged.iterdir()) if staged.is_dir() else []:
        for kind in ("chain", "full"):
            if rank == 0:
                for node in range(world):
                    shutil.rmtree(shm / f"n{node}", ignore_errors=True)
                for node_dir in (staged / label / kind).iterdir():
                    shutil.copytree(node_dir, shm / node_dir.name)
            dist.barrier()
            res["chains"].setdefault(label, {})[kind] = restore_in(spec, rank, world, dmp, plan, dense_opt)
    return res


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    out = []
    for k, ph in enumerate(spec["phases"]):
        if rank >= ph["world"]:
            continue
        import torchrec.distributed.collective_utils as trec_cu

        trec_cu._INITIALIZED = False  # once-per-process handshake; each phase is a new world
        store = dist.FileStore(str(Path(spec["workdir"]) / f"store-{spec['mode']}-{k}"), ph["world"])
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=ph["world"], timeout=datetime.timedelta(seconds=900)
        )
        peers = ph.get("peers", {}).get(f"n{rank}")
        if peers is None:
            os.environ.pop(PEERS_ENV, None)
        else:
            os.environ[PEERS_ENV] = json.dumps(peers)
        if ph["kind"] == "train":
            res = phase_train(spec, rank)
        else:
            res = phase_restore(spec, rank, ph["world"])
        res["phase"] = k
        out.append(res)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    Path(spec["workdir"], f"result-{spec['mode']}-{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
