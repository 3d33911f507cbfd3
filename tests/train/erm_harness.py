"""Launch the test worker as N real processes (gloo, TorchRec), wait with a timeout, collect results,
and compare dumped tensors (assembled from every rank's pieces, each element covered exactly once)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

WORKER = Path(__file__).with_name("erm_train_worker.py")
REPO = Path(__file__).resolve().parents[2]


def run_world(nprocs: int, spec: dict[str, Any], workdir: Path, timeout: float = 240) -> list[list[Any]]:
    """Run the phases of `spec` on `nprocs` processes; per-rank list of per-phase results."""
    workdir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "workdir": str(workdir)}
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    procs, logs = [], []
    for rank in range(nprocs):
        log = open(workdir / f"log-{rank}.txt", "w")
        logs.append(log)
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), str(spec_path), str(rank), str(nprocs)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=REPO,
            )
        )
    deadline = time.monotonic() + timeout
    try:  # stop early when one rank fails: the others would only wait for it until their timeouts
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # by pid: only the processes this harness started
                p.wait(timeout=30)
        for log in logs:
            log.close()
    failed = [r for r, p in enumerate(procs) if p.returncode != 0]
    if failed:
        tails = "\n".join(
            f"--- rank {r} (rc {procs[r].returncode}) ---\n" + (workdir / f"log-{r}.txt").read_text()[-4000:]
            for r in failed
        )
        raise AssertionError(f"worker ranks {failed} failed or timed out after {timeout}s:\n{tails}")
    return [json.loads((workdir / f"result-{r}.json").read_text())["results"] for r in range(nprocs)]


def assemble(workdir: Path, name: str) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's dump; sharded elements must be covered exactly once and
    replicated tensors must be equal on every rank."""
    dumps = [torch.load(p, weights_only=True) for p in sorted((workdir / "dump" / name).glob("rank*.pt"))]
    assert dumps, f"no dump named {name}"
    keys = sorted({k for d in dumps for k in d})
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        entries = [d[key] for d in dumps if key in d]
        shape = entries[0]["shape"]
        if entries[0]["replicated"]:
            first = entries[0]["pieces"][0][1]
            for e in entries[1:]:
                assert torch.equal(e["pieces"][0][1], first), (
                    f"{name}: replicated {key} differs between ranks"
                )
            out[key] = first
            continue
        dtype = entries[0]["pieces"][0][1].dtype if entries[0]["pieces"] else torch.float32
        full = torch.zeros(shape, dtype=dtype)
        covered = torch.zeros(shape, dtype=torch.int32)
        for e in entries:
            for off, t in e["pieces"]:
                sl = tuple(slice(o, o + s) for o, s in zip(off, t.shape, strict=True))
                full[sl] = t
                covered[sl] += 1
        assert int(covered.min()) == 1 and int(covered.max()) == 1, (
            f"{name}: {key} coverage min {int(covered.min())} max {int(covered.max())} (want exactly once)"
        )
        out[key] = full
    return out


def canonical(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Key names independent of the sharding: dense-optimizer keys of data-parallel tables carry
    DMP wrapper prefixes that depend on the plan; keep only the table and state name."""
    out = {}
    for k, v in state.items():
        if k.startswith("d."):
            parts = k.split(".")
            k = (
                "d." + ".".join(parts[parts.index("embedding_bags") + 1 :])
                if "embedding_bags" in parts
                else k
            )
        out[k] = v
    return out


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> int:
    a, b = canonical(a), canonical(b)
    assert sorted(a) == sorted(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))}"
    for k in a:
        assert a[k].shape == b[k].shape, f"{what}: {k} shape {tuple(a[k].shape)} vs {tuple(b[k].shape)}"
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs (max {float((a[k] - b[k]).abs().max()):.3e})"
    return sum(v.numel() for v in a.values())


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    a, b = canonical(a), canonical(b)
    assert sorted(a) == sorted(b), f"keys differ: {sorted(set(a) ^ set(b))}"
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)
