"""TorchRec's golden train_dlrm.py made elastic (examples/golden/train_dlrm.py) under real ermrun nodes:
a world of 2, one node killed (SIGKILL) so the survivor goes on alone, the node back (a planned round:
the survivor keeps its process, elastic_rounds), and a world of 2 again. The final checkpoint equals,
bit for bit, a replay of the same world-size schedule started from scratch (every value of the tables,
the fused row-wise Adagrad state, the dense layers and their Adagrad state), and its sample ledger
counts every step's global batch once."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from elastic_rm.checkpoint.node_memory import run_memory_dir
from elastic_rm.train.ledger import RangeLedger
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import wait_until
from tests.ermrun_argv import ermrun_argv, flags, node_args

SCRIPT = os.path.join(REPO, "examples", "golden", "train_dlrm.py")
GLOBAL_BATCH = 16
ARGS = [
    "--num-embeddings",
    "100",
    "--embedding-dim",
    "4",
    "--dense-arch-layer-sizes",
    "8",
    "4",
    "--over-arch-layer-sizes",
    "8",
    "1",
    "--global-batch-size",
    str(GLOBAL_BATCH),
    "--checkpoint-every",
    "5",
]
RESTORED = re.compile(r"elastic-rm: world (\d+): (?:restored step (\d+)|fresh start)")


def node(tmp_path: Path, etcd, run_id: str, name: str, log: str) -> Proc:
    argv = ermrun_argv(
        *node_args(etcd.endpoint, run_id, "1:2", name, conf="lease_ttl=2,last_call_timeout=3"),
        SCRIPT,
        *ARGS,
        *flags(num_iterations=1000000, checkpoint_dir=tmp_path / "ckpt"),
        monitor_interval=0.1,
        max_restarts=3,
    )
    return Proc(argv, str(tmp_path / log), env={"OMP_NUM_THREADS": "1"})


def committed(durable: Path) -> list[tuple[int, int]]:
    """(step, world size) of the committed durable checkpoints. The run prunes old steps while this
    polls: a step whose manifest is gone between the listing and the read is skipped."""
    out = []
    for d in durable.glob("step-*") if durable.is_dir() else []:
        if d.name.endswith(".tmp"):
            continue
        try:
            manifest = json.loads((d / "manifest.json").read_text())
        except FileNotFoundError:
            continue
        out.append((int(d.name.split("-")[1]), manifest["world_size"]))
    return sorted(out)


def schedule(logs: list[str]) -> list[tuple[int, int]]:
    """(world, restored step; 0: fresh) of every round, oldest first (restored steps only grow)."""
    rounds = sorted((int(m[1] or 0), int(m[0])) for text in logs for m in RESTORED.findall(text))
    steps = [s for s, _ in rounds]
    assert len(set(steps)) == len(steps), f"two rounds restored the same step: {rounds}"
    return [(w, s) for s, w in rounds]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replay(tmp_path: Path, run_id: str, phases: list[tuple[int, int]], end: int) -> Path:
    """Train the same schedule from scratch, each phase a new world of plain processes (no agent) that
    trains to the next phase's step and saves; returns the durable directory."""
    durable = tmp_path / "replay-ckpt"
    stops = [s for _, s in phases[1:]] + [end]
    for i, ((world, _start), stop) in enumerate(zip(phases, stops, strict=True)):
        port = free_port()
        workers = []
        for rank in range(world):
            # one rank per simulated node, as under the ermrun nodes: the same topology, the same plan
            env = {
                "RANK": str(rank),
                "GROUP_RANK": str(rank),
                "LOCAL_RANK": "0",
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": "1",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "ERM_RUN_ID": run_id,
                "ERM_NODE_ID": "replay",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": REPO,
            }
            argv = [
                os.path.join(BIN, "python"),
                SCRIPT,
                *ARGS,
                "--num-iterations",
                str(stop),
                "--checkpoint-dir",
                str(durable),
            ]
            workers.append(Proc(argv, str(tmp_path / f"replay-{i}-{rank}.log"), env=env))
        try:
            for w in workers:
                assert w.wait(180) == 0, w.output()[-3000:]
        finally:
            for w in workers:
                w.stop()
    return durable


def final_state(step_dir: Path, out: Path) -> dict[str, torch.Tensor]:
    dcp_to_torch_save(step_dir, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: object) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    walk("", torch.load(out, weights_only=False))
    return flat


# 46 s; CI keeps the golden script's pipeline in-process (tests/train/test_delta_pipeline.py,
# test_prefetch_batches.py) and rounds in place end to end (test_inplace_rounds.py, test_inplace_loss.py)
@pytest.mark.slow
def test_golden_script_elastic_2_1_2_equals_a_replay(etcd, run_id, tmp_path: Path, procs) -> None:
    durable = tmp_path / "ckpt"
    replay_id = f"{run_id}-replay"
    try:
        a, b = node(tmp_path, etcd, run_id, "a", "a.log"), node(tmp_path, etcd, run_id, "b", "b.log")
        procs.extend([a, b])
        wait_until(
            lambda: any(s >= 10 and w == 2 for s, w in committed(durable)), 240, "world 2 at step 10", [a, b]
        )
        b.signal(signal.SIGKILL)  # the node is lost: a's worker fails, a goes on alone
        b.wait(30)
        wait_until(lambda: "world 1: restored step" in a.output(), 240, "a restored alone", [a])
        wait_until(lambda: any(w == 1 for _s, w in committed(durable)), 240, "a world-1 checkpoint", [a])
        b2 = node(tmp_path, etcd, run_id, "b", "b2.log")  # b is back: a planned round of 2
        procs.append(b2)

        def back_at_two() -> bool:
            phases = schedule([a.output(), b.output(), b2.output()])
            if [w for w, _ in phases] != [2, 1, 2]:
                return False
            return any(w == 2 and s >= phases[-1][1] + 5 for s, w in committed(durable))

        wait_until(back_at_two, 240, "a checkpoint at world 2 after the rejoin", [a, b2])
        for p in (a, b2):  # the job ends: its newest committed checkpoint is the final state (SIGKILL, so
            p.signal(signal.SIGKILL)  # that no node goes on alone in a round of its own)
        for p in (a, b2):
            p.wait(60)
        text = [a.output(), b.output(), b2.output()]
        phases = schedule(text)
        assert [w for w, _ in phases] == [2, 1, 2], phases
        assert phases[0][1] == 0  # a fresh start
        end, world = committed(durable)[-1]
        assert world == 2 and end > phases[-1][1], (end, phases)
        # a kept its worker process across the planned round (elastic_rounds: rounds in place)
        assert re.search(r"round \d+ in place: 1 worker\(s\) kept their processes", a.output()), a.output()[
            -3000:
        ]

        mine = final_state(durable / f"step-{end:08d}", tmp_path / "elastic.pt")
        theirs_dir = replay(tmp_path, replay_id, phases, end)
        theirs = final_state(theirs_dir / f"step-{end:08d}", tmp_path / "replay.pt")
        assert sorted(mine) == sorted(theirs)
        assert any(k.startswith("optim.") for k in mine) and any(k.startswith("dense_optim.") for k in mine)
        for k in mine:
            assert torch.equal(mine[k], theirs[k]), f"{k} differs from the replay"
        positions = [
            json.loads((d / f"step-{end:08d}" / "manifest.json").read_text())["position"]
            for d in (durable, theirs_dir)
        ]
        assert positions[0] == positions[1]  # the same ledger: the same samples, each once
        ledger = RangeLedger.from_checkpoint(positions[0]["ledger"])
        assert ledger.samples_done() == end * GLOBAL_BATCH and positions[0]["step"] == end
    finally:
        for rid in (run_id, replay_id):
            shutil.rmtree(run_memory_dir(rid), ignore_errors=True)
