"""Worker process for tests/train: runs a list of phases, each one a world of its own (ranks >= the
phase's world size sit it out), so one launch of N processes covers several world-size changes.

    python erm_train_worker.py SPEC.json RANK NPROCS

Every phase initialises gloo from a FileStore of its own, builds the model with the elastic planner
for that world, runs its actions, then tears down (gc.collect() before destroy_process_group).
Results go to <workdir>/result-<rank>.json; tensor dumps to <workdir>/dump/<name>/rank<r>.pt.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torchrec.optim as trec_optim
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from elastic_rm.checkpoint import flash as flash_module
from elastic_rm.checkpoint.manifest import CorruptCheckpointError
from elastic_rm.checkpoint.peers import PEERS_ENV
from elastic_rm.checkpoint.snapshot import dense_optimizer_state, local_pieces
from elastic_rm.train import (
    ElasticRules,
    FlashCheckpointer,
    FlashConfig,
    WorldTopology,
    dense_parameters,
    plan_sharding,
    wrap_model,
)
from elastic_rm.train.ledger import RangeLedger

GLOBAL_BATCH = 12  # divisible by 1, 2 and 3: the loss is a mean over a fixed global batch
LR, EPS = 0.1, 1e-8


class Net(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig], device: torch.device, num_samples: int = 1) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=device)
        self.features = [f for t in tables for f in t.feature_names]
        self.register_buffer("seen", torch.zeros(num_samples))  # how often each sample is in the state

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        d = self.ebc(kjt).to_dict()  # index by key: sharded output order differs from table order
        return torch.cat([d[f] for f in self.features], dim=1)


def make_tables(spec: dict[str, Any]) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=t["name"], embedding_dim=t["dim"], num_embeddings=t["rows"], feature_names=[f"f_{t['name']}"]
        )
        for t in spec["tables"]
    ]


def global_batch(tables: list[EmbeddingBagConfig], seed: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    keys, lengths, values = [], [], []
    for t in tables:
        ls = torch.randint(0, 4, (GLOBAL_BATCH,), generator=g)
        keys.append(t.feature_names[0])
        lengths.append(ls)
        values.append(torch.randint(0, t.num_embeddings, (int(ls.sum()),), generator=g))
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(values), lengths=torch.cat(lengths))
    coef = torch.randn(GLOBAL_BATCH, sum(t.embedding_dim for t in tables), generator=g)
    return kjt, coef


def local_slice(kjt: KeyedJaggedTensor, rank: int, world: int) -> KeyedJaggedTensor:
    per = kjt.stride() // world
    lo, hi = rank * per, (rank + 1) * per
    keys, lens, vals = [], [], []
    for k in kjt.keys():
        jt = kjt[k]
        off = torch.ops.fbgemm.asynchronous_complete_cumsum(jt.lengths())
        keys.append(k)
        lens.append(jt.lengths()[lo:hi])
        vals.append(jt.values()[off[lo] : off[hi]])
    return KeyedJaggedTensor.from_lengths_sync(keys=keys, values=torch.cat(vals), lengths=torch.cat(lens))


class World:
    """One phase's model, optimizers and checkpointer."""

    def __init__(self, spec: dict[str, Any], phase: dict[str, Any], rank: int) -> None:
        self.spec, self.phase, self.rank = spec, phase, rank
        self.world = phase["world"]
        self.tables = make_tables(spec)
        model = Net(self.tables, torch.device("meta"), spec.get("num_samples", 1))
        dp = set(spec.get("data_parallel", []))
        optim_cls = {"adagrad": torch.optim.Adagrad, "rowwise_adagrad": trec_optim.RowWiseAdagrad}[
            spec["optim"]
        ]
        fused = [p for n, p in model.ebc.named_parameters() if n.split(".")[1] not in dp]
        apply_optimizer_in_backward(optim_cls, fused, {"lr": LR, "eps": EPS})
        rules = ElasticRules(
            data_parallel=frozenset(dp),
            column_wise=spec.get("column_wise", {}),
            pinned=phase.get("pinned", {}),
        )
        self.plan = plan_sharding(model, WorldTopology(self.world, self.world), rules)
        self.dmp = wrap_model(model, self.plan)
        dense = [p for _, p in dense_parameters(self.dmp)]
        self.dense_opt = torch.optim.Adagrad(dense, lr=LR, eps=EPS) if dense else None
        # the agent's part: this round's peers' checkpoint servers (absent: none, as under plain torchrun)
        peers = phase.get("peers", {}).get(phase["nodes"][rank])
        if peers is None:
            os.environ.pop(PEERS_ENV, None)
        else:
            os.environ[PEERS_ENV] = json.dumps(peers)
        fc = dict(phase.get("flash", {}))
        cfg = FlashConfig(
            run_id="test",
            node_id=phase["nodes"][rank],
            memory_root=Path(fc.pop("memory_root")),
            durable_dir=Path(fc["durable_dir"]) if fc.get("durable_dir") else None,
            replicate=fc.get("replicate", False),
            keep_memory=fc.get("keep_memory", 2),
            keep_durable=fc.get("keep_durable", 2),
            sync_durable=False,
            differential=fc.get("differential", False),
            compact_ratio=fc.get("compact_ratio", 1.0),
            persist_every=fc.get("persist_every", 1),
        )
        self.ckpt = FlashCheckpointer(self.dmp, self.plan, self.dense_opt, cfg)
        self.step = 0

    def local_fused_tables(self) -> int:
        """Fused tables with optimizer state on this rank (0: the empty-optim-dict case)."""
        state = self.dmp.fused_optimizer.state_dict()["state"]
        return sum(any(t.numel() for v in s.values() for _, t in local_pieces(v)) for s in state.values())

    def init_weights(self) -> None:
        sd = self.dmp.state_dict()
        with torch.no_grad():
            for i, t in enumerate(self.tables):
                full = torch.randn(
                    t.num_embeddings, t.embedding_dim, generator=torch.Generator().manual_seed(100 + i)
                )
                for off, loc in local_pieces(sd[f"ebc.embedding_bags.{t.name}.weight"]):
                    loc.copy_(full[off[0] : off[0] + loc.shape[0], off[1] : off[1] + loc.shape[1]])

    def train(self, seed: int) -> None:
        kjt, coef = global_batch(self.tables, seed)
        per = GLOBAL_BATCH // self.world
        out = self.dmp(local_slice(kjt, self.rank, self.world))
        loss = (out * coef[self.rank * per : (self.rank + 1) * per]).sum() / per
        loss.backward()
        if self.dense_opt is not None:
            self.dense_opt.step()
            self.dense_opt.zero_grad()
        self.step += 1

    def ledger_train(self, a: dict[str, Any], res: dict[str, Any]) -> None:
        """Rank 0 owns the ledger and hands one range (= one global batch) per step to all ranks; the
        ledger's state is saved in the checkpoint's position, so its done marks commit with it."""
        restored = (res.get("restores") or [None])[-1]
        if restored is not None:
            led = RangeLedger.from_checkpoint(restored["position"]["ledger"])
            self.step = restored["position"]["step"]
        else:
            led = RangeLedger(self.spec["num_samples"], GLOBAL_BATCH)
            self.step = 0
        trained = res.setdefault("ranges_trained", [])
        while True:
            r = led.acquire(f"rank{self.rank}") if self.rank == 0 else None
            t = torch.tensor([r.id, r.start, r.end] if r is not None else [-1, -1, -1])
            dist.broadcast(t, 0)
            rid, lo, hi = (int(x) for x in t)
            if rid < 0:
                break
            assert hi - lo == GLOBAL_BATCH, "ranges are whole global batches in this test"
            self.train(10_000 + rid)
            with torch.no_grad():
                self.dmp.module.seen[lo:hi] += 1
            trained.append(rid)
            if self.rank == 0:
                led.report(rid, hi)
            if a.get("crash_after") == self.step:
                return  # the process dies here: nothing after the last checkpoint survives
            last = torch.tensor([int(self.rank == 0 and led.exhausted())])
            dist.broadcast(last, 0)  # only rank 0's ledger knows; the save is collective
            if self.step % a["every"] == 0 or bool(last):
                self.ckpt.save(self.step, {"step": self.step, "ledger": led.checkpoint_state()}, block=True)
        res["ledger_final"] = led.checkpoint_state()

    def pieces(self) -> dict[str, Any]:
        """Every local piece of weights, fused optimizer state and dense optimizer state."""
        out: dict[str, Any] = {}

        def add(key: str, value: Any) -> None:
            if isinstance(value, ShardedTensor):
                out[key] = {"shape": list(value.size()), "replicated": False, "pieces": local_pieces(value)}
            elif isinstance(value, torch.Tensor):
                out[key] = {
                    "shape": list(value.shape),
                    "replicated": True,
                    "pieces": [([0] * value.dim(), value)],
                }
            out[key]["pieces"] = [(o, t.detach().clone()) for o, t in out[key]["pieces"]]

        for k, v in self.dmp.state_dict().items():
            add(f"w.{k}", v)
        for pk, states in self.dmp.fused_optimizer.state_dict()["state"].items():
            for sk, v in states.items():
                add(f"o.{pk}.{sk}", v)
        if self.dense_opt is not None:
            for name, states in dense_optimizer_state(self.dmp, self.dense_opt).items():
                for sk, v in states.items():
                    add(f"d.{name}.{sk}", v)
        return out


def corrupt(path: Path, how: str) -> None:
    if how == "flip":
        data = bytearray(path.read_bytes())
        i = len(data) // 2
        data[i] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size // 2)
    elif how == "rm":
        path.unlink()
    else:
        raise ValueError(how)


def matching(root: Path, step: int, file: str) -> list[Path]:
    return sorted(p for p in root.rglob(file) if p.parent.name == f"step-{step:08d}")


def run_action(w: World, a: dict[str, Any], workdir: Path, res: dict[str, Any]) -> None:
    do = a["do"]
    if do == "init":
        w.init_weights()
    elif do == "train":
        for seed in a["seeds"]:
            w.train(seed)
    elif do == "save":
        stats = w.ckpt.save(
            a["step"], position=a.get("position", {"step": a["step"]}), block=a.get("block", True)
        )
        res.setdefault("saves", []).append(
            {
                "step": a["step"],
                "pause_s": stats.pause_s,
                "bytes": stats.bytes,
                "kind": stats.kind,
                "rows_touched": stats.rows_touched,
                "rows_total": stats.rows_total,
                "tables_full": stats.tables_full,
                "reason": stats.reason,
                "memory_peak_bytes": w.ckpt.memory_peak_bytes,  # a blocking save's is final
                "replicated_everywhere": w.ckpt.replicated_everywhere,
                "bytes_pushed": w.ckpt.bytes_pushed,  # to the ring peer, since the start
                "cpu_seconds": dict(w.ckpt.cpu_seconds),  # a blocking save's parts are all counted
            }
        )
    elif do == "ledger_train":
        w.ledger_train(a, res)
    elif do == "wait":
        failed = w.ckpt.wait()
        res.setdefault("waits", []).append(
            {"failed": failed, "replicated_everywhere": w.ckpt.replicated_everywhere}
        )
    elif do == "prepare":
        w.ckpt.prepare()
    elif do == "restore":
        try:
            r = w.ckpt.restore()
        except CorruptCheckpointError as e:
            res.setdefault("restores", []).append({"error": str(e)})
            return
        res.setdefault("restores", []).append(
            None
            if r is None
            else {
                "step": r.step,
                "position": r.position,
                "skipped": r.skipped,
                "sources": sorted(set(r.file_sources.values())),
                "file_sources": r.file_sources,
                "saved_world": r.manifest["world_size"],
            }
        )
    elif do == "exit_before_peer_fold":  # this node's processes exit (as under SIGKILL) once every
        # node folded its own memory, before the node asks its ring peer to fold its replica
        if w.ckpt.node == a["node"]:
            w.ckpt._push_fold = lambda step, body: os._exit(137)
    elif do == "fail_fold_entries":  # this rank's next fold fails as it computes its files' checksums,
        # with an error no fold expects (a MemoryError, say)
        if w.rank == a["rank"]:

            def fail(*_args: Any, **_kwargs: Any) -> Any:
                raise MemoryError("injected by the test")

            flash_module.folded_entry = fail
    elif do == "dump":
        d = workdir / "dump" / a["name"]
        d.mkdir(parents=True, exist_ok=True)
        torch.save(w.pieces(), d / f"rank{w.rank}.pt")
    elif do in ("corrupt", "rm_dir", "copy_dir", "kill", "cut"):
        if w.rank == 0:
            if do == "kill":  # a node's agent (its checkpoint server), started by the test: by its pid
                os.kill(a["pid"], signal.SIGKILL)
            elif do == "rm_dir":
                shutil.rmtree(a["path"])
            elif do == "copy_dir":
                shutil.copytree(a["path"], a["to"])
            elif do == "cut":  # one file, wherever it is (a temporary directory too)
                corrupt(Path(a["path"]), a["how"])
            else:
                hits = [p for root in a["roots"] for p in matching(Path(root), a["step"], a["file"])]
                assert hits, f"nothing to corrupt: {a}"
                for p in hits:
                    corrupt(p, a["how"])
                res.setdefault("corrupted", []).append([str(p) for p in hits])
        dist.barrier()
    else:
        raise ValueError(f"unknown action {do}")


def main() -> None:
    spec_path, rank, _nprocs = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    spec = json.loads(spec_path.read_text())
    workdir = Path(spec["workdir"])
    results: list[Any] = []
    try:
        for k, phase in enumerate(spec["phases"]):
            if rank >= phase["world"]:
                results.append(None)
                continue
            # torchrec caches a once-per-process collective handshake; a new world in the same process
            # must redo it on every rank (torchrun would start fresh processes instead)
            import torchrec.distributed.collective_utils as trec_cu

            trec_cu._INITIALIZED = False
            store = dist.FileStore(str(workdir / f"store-{k}"), phase["world"])
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=phase["world"],
                timeout=datetime.timedelta(seconds=120),
            )
            t0 = time.perf_counter()
            w = World(spec, phase, rank)
            res: dict[str, Any] = {
                "phase": k,
                "build_s": time.perf_counter() - t0,
                "fused_tables": w.local_fused_tables(),
            }
            for a in phase["actions"]:
                run_action(w, a, workdir, res)
            w.ckpt.close()
            res["phase_s"] = time.perf_counter() - t0
            results.append(res)
            del w
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        (workdir / f"result-{rank}.json").write_text(json.dumps({"ok": False, "results": results}))
        sys.stdout.flush()
        os._exit(1)
    (workdir / f"result-{rank}.json").write_text(json.dumps({"ok": True, "results": results}))


if __name__ == "__main__":
    main()
