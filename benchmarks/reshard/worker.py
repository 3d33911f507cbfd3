"""One rank of the reshard benchmark (started by `python -m benchmarks.reshard`).

Phases: world 2 (fill, save) -> world 3 (restore, save) -> world 2 (restore). Every phase measures the
memcpy floor of its own state bytes, the flash-checkpoint step pause and restore, a synchronous
DCP save to / load from a local disk directory, and torch's `dcp.async_save` to the same disk. Values are
an exact-in-fp32 function of (row, col), so every rank checks every element it holds after each restore
without any gather.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from elastic_rm.checkpoint.peers import PEERS_ENV, PeerEndpoint
from elastic_rm.checkpoint.snapshot import app_state, load_app_state, local_pieces
from elastic_rm.checkpoint.sources import HttpPeerSource, memory_sources
from elastic_rm.train import FlashCheckpointer, FlashConfig, WorldTopology, plan_sharding, wrap_model

CHUNK = 1 << 16


class Net(nn.Module):
    def __init__(self, tables: list[EmbeddingBagConfig]) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def pattern(row0: int, rows: int, col0: int, cols: int, salt: int) -> torch.Tensor:
    r = torch.arange(row0, row0 + rows, dtype=torch.int64)[:, None]
    c = torch.arange(col0, col0 + cols, dtype=torch.int64)[None, :]
    return ((r * 131 + c * 7 + salt) % 1_000_003).to(torch.float32)


def tensors(dmp: Any) -> list[tuple[int, list[int], torch.Tensor]]:
    """(salt, offsets, local tensor) of every local weight and optimizer-state piece."""
    out = []
    for i, (k, v) in enumerate(sorted(dmp.state_dict().items())):
        out += [(1000 * i, off, t) for off, t in local_pieces(v)]
        for j, sv in enumerate(dmp.fused_optimizer.state_dict()["state"].get(k, {}).values()):
            out += [(1000 * i + 17 + j, off, t) for off, t in local_pieces(sv)]
    return out


@torch.no_grad()
def fill_or_check(dmp: Any, check: bool) -> int:
    bad = 0
    for salt, off, t in tensors(dmp):
        t2 = t.view(t.shape[0], -1)
        for lo in range(0, t2.shape[0], CHUNK):
            hi = min(lo + CHUNK, t2.shape[0])
            ref = pattern(off[0] + lo, hi - lo, off[1] if len(off) > 1 else 0, t2.shape[1], salt).to(
                t2.device
            )
            if check:
                bad += int((t2[lo:hi] != ref).sum())
            else:
                t2[lo:hi].copy_(ref)
    return bad


def _reduce(x: float, op: Any = dist.ReduceOp.SUM) -> float:
    """All-reduce one number (on the GPU under NCCL, which reduces device tensors only)."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t)


def timed(fn: Any) -> float:
    """Wall time of a collective section: barrier, run, barrier; the slowest rank's view."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    dist.barrier()
    return slowest(time.perf_counter() - t0)


def slowest(x: float) -> float:
    return _reduce(x, dist.ReduceOp.MAX)


def total(x: float) -> float:
    return _reduce(x)


def run_phase(spec: dict[str, Any], k: int, rank: int) -> dict[str, Any]:
    ph = spec["phases"][k]
    world = ph["world"]
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=spec["dim"], num_embeddings=spec["rows"], feature_names=[f"f{i}"]
        )
        for i in range(spec["tables"])
    ]
    model = Net(tables)
    apply_optimizer_in_backward(torch.optim.Adagrad, model.ebc.parameters(), {"lr": 0.01, "eps": 1e-8})
    plan = plan_sharding(model, WorldTopology(world, world, device=ph.get("device", "cpu")))
    dmp = wrap_model(model, plan)
    peers = ph.get("peers", {}).get(f"n{rank}")  # as the agent sets it: the other members' servers
    if peers is None:
        os.environ.pop(PEERS_ENV, None)
    else:
        os.environ[PEERS_ENV] = json.dumps(peers)
    cfg = FlashConfig(
        run_id="bench",
        node_id=ph.get("node", f"n{rank}"),  # one node per rank, unless the phase puts all ranks on one
        memory_root=Path(spec["shm"]),
        keep_memory=1,
        replicate=True,
    )
    ckpt = FlashCheckpointer(dmp, plan, config=cfg)
    res: dict[str, Any] = {"world": world, "plan": {n: p["type"] for n, p in plan_summary_ebc(plan).items()}}
    local = [t for _, _, t in tensors(dmp)]
    res["state_bytes"] = total(sum(t.numel() * t.element_size() for t in local))
    # the floor is a copy into host memory, which is where a flash snapshot goes (device -> host on a GPU)
    held = {"bufs": [torch.empty(t.shape, dtype=t.dtype, device="cpu") for t in local]}

    def memcpy() -> None:
        for b, t in zip(held["bufs"], local, strict=True):
            b.copy_(t)

    memcpy()  # fault the buffers in: the floor is a warm copy
    res["memcpy_s"] = timed(memcpy)
    held.clear()
    gc.collect()
    if ph.get("restore"):
        got: dict[str, Any] = {}
        res["flash_restore_s"] = timed(lambda: got.update(r=ckpt.restore()))
        res["flash_verify_s"] = slowest(got["r"].verify_s)
        res["flash_dcp_load_s"] = slowest(got["r"].load_s)
        ckpt.cfg.verify_checksums = False  # the same restore again without hashing (sizes only)
        res["flash_restore_noverify_s"] = timed(lambda: got.update(r=ckpt.restore()))
        ckpt.cfg.verify_checksums = True
        res["flash_restore_bad"] = total(fill_or_check(dmp, check=True))
        if spec.get("servers"):
            res.update(network_vs_memory(spec, ckpt, dmp, rank))
        with torch.no_grad():
            for t in local:
                t.zero_()
        state = app_state(dmp)

        def disk_load() -> None:
            dcp.load(state, storage_reader=FileSystemReader(ph["disk_from"]))
            load_app_state(dmp, state)

        if ph.get("disk_from"):
            res["disk_restore_s"] = timed(disk_load)
            res["disk_restore_bad"] = total(fill_or_check(dmp, check=True))
    else:
        fill_or_check(dmp, check=False)
    if ph.get("save"):
        for i, name in enumerate(("flash_cold", "flash_warm")):
            if name == "flash_warm":
                ckpt._snap.clear()  # start over and pre-allocate, as a script would at start-up
                gc.collect()
                res["flash_prepare_s"] = slowest(ckpt.prepare())
            dist.barrier()
            stats = ckpt.save(10 * k + i, position={"step": 10 * k + i})
            res[f"{name}_pause_s"] = slowest(stats.pause_s)
            t0 = time.perf_counter()
            ckpt.wait()
            res[f"{name}_background_s"] = slowest(stats.pause_s + time.perf_counter() - t0)
        res["flash_bytes"] = total(stats.bytes)
        if ph.get("disk_to"):
            res["disk_save_s"] = timed(
                lambda: dcp.save(
                    app_state(dmp), storage_writer=FileSystemWriter(ph["disk_to"], sync_files=True)
                )
            )
            res.update(async_disk_save(dmp, ph["disk_to"] + "-async"))
    ckpt.close()
    return res


def async_disk_save(dmp: Any, path: str) -> dict[str, Any]:
    """torch's own non-blocking save: `dcp.async_save` stages the state in CPU memory, then writes it in a
    thread. The step pause is how long the training loop is blocked (until the call returns and, when
    torch stages asynchronously, until staging is done: only then may the next step change the weights);
    the total is until the files are on disk (fsync). Slowest rank of each."""
    group = dist.new_group(backend="gloo")  # its background collectives never interleave with ours
    dist.barrier()
    t0 = time.perf_counter()
    pending = dcp.async_save(
        app_state(dmp), storage_writer=FileSystemWriter(path, sync_files=True), process_group=group
    )
    done = pending
    if hasattr(pending, "staging_completion"):  # an AsyncSaveResponse: staging may still run
        pending.staging_completion.result()
        done = pending.upload_completion
    pause = time.perf_counter() - t0
    done.result()
    total_s = time.perf_counter() - t0
    dist.destroy_process_group(group)
    return {"async_save_pause_s": slowest(pause), "async_save_total_s": slowest(total_s)}


def network_vs_memory(spec: dict[str, Any], ckpt: FlashCheckpointer, dmp: Any, rank: int) -> dict[str, Any]:
    """The same restore twice, every file from one kind of place: straight from the nodes' memory
    directories (the floor: what a node holding every file itself would read), then every file over
    HTTP from the nodes' checkpoint servers (this node's own included), into this node's memory."""
    nodes = sorted(spec["servers"])
    shm = Path(spec["shm"])
    mem = [src for n in nodes for src in memory_sources(f"mem:{n}", shm / n)]
    cache = shm / f"n{rank}" / "fetch" / f"bench-rank{rank}"
    http = [HttpPeerSource(PeerEndpoint(**spec["servers"][n]), cache / n, timeout_s=120) for n in nodes]
    out: dict[str, Any] = {}
    got: dict[str, Any] = {}
    out["mem_all_restore_s"] = timed(lambda: got.update(r=ckpt.restore(sources=mem)))
    r = got["r"]  # the files this rank needed; the memory path reads only the ranges it loads from them
    out["files_needed_bytes"] = total(sum(r.manifest["files"][f]["size"] for f in r.file_sources))
    out["http_all_restore_s"] = timed(lambda: got.update(r=ckpt.restore(sources=http)))
    out["http_all_sources"] = sorted(set(got["r"].file_sources.values()))
    out["http_all_fetched_bytes"] = total(sum(s.bytes_fetched for s in http))
    out["http_all_restore_bad"] = total(fill_or_check(dmp, check=True))
    return out


def plan_summary_ebc(plan: Any) -> dict[str, Any]:
    from elastic_rm.checkpoint.plan_record import plan_summary

    return plan_summary(plan)["ebc"]


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    rank = int(sys.argv[2])
    out = []
    for k, ph in enumerate(spec["phases"]):
        if rank >= ph["world"]:
            continue
        import torchrec.distributed.collective_utils as trec_cu

        trec_cu._INITIALIZED = False  # once-per-process handshake; each phase is a new world
        store = dist.FileStore(str(Path(spec["workdir"]) / f"store-{k}"), ph["world"])
        backend = ph.get("backend", "gloo")  # "nccl": this phase's model lives on cuda:<rank>
        if backend == "nccl":
            torch.cuda.set_device(rank)
            os.environ["LOCAL_RANK"] = str(rank)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=ph["world"], timeout=datetime.timedelta(seconds=300)
        )
        res = run_phase(spec, k, rank)
        res["phase"] = k
        out.append(res)
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    Path(spec["workdir"], f"result-{rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
