"""`erm gc` removes only directories that elastic-rm made (a claim, or a run's node-memory layout): a
mistaken --root (or $ELASTIC_RM_MEMORY_ROOT) never loses a user's files."""

from __future__ import annotations

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

from elastic_rm.checkpoint.node_memory import ENV_MEMORY_ROOT
from elastic_rm.checkpoint.owners import OWNERS, claim, live_owners
from launcher.erm import main

LEFT = "not elastic-rm node memory: left alone"


def _gc(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["gc", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _step(node_dir: Path, step: int, manifest: bool = True) -> None:
    """A flash checkpoint's step directory, as manifest.py lays it out."""
    d = node_dir / (f"step-{step:08d}" if manifest else f"step-{step:08d}.tmp")
    d.mkdir(parents=True)
    (d / "__0_0.distcp").write_bytes(b"0" * 4096)
    if manifest:
        (d / "manifest.json").write_text(json.dumps({"format": "elastic-rm-flash", "step": step}))


def _user_files(root: Path) -> list[Path]:
    """Directories a user might keep where a mistaken --root points, each with a file that must survive."""
    files = [
        root / "myproject" / "src" / "main.py",  # a source tree
        root / "ckpts" / "exp1" / "step-1000" / "model.pt",  # the user's own checkpoints, no manifest
        root / "notes" / "todo.txt",
        root / "odd" / OWNERS / "alice",  # a directory named like the claims', holding something else
    ]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text("precious")
    mixed = root / "mixed"  # node memory's layout, plus a file elastic-rm never writes there
    _step(mixed / "n0", 3)
    (mixed / "n0" / "train.py").write_text("precious")
    files.append(mixed / "n0" / "train.py")
    return files


def _node_memory(root: Path) -> list[Path]:
    """What crashed runs leave: claimed (a dead owner), unclaimed with steps, an unfinished step only,
    a peer's replica only."""
    dead = root / "claimed-run"
    (dead / OWNERS).mkdir(parents=True)
    (dead / OWNERS / "999999999-12345").touch()  # no such pid: not live
    _step(dead / "n0", 1)
    _step(root / "killed-run" / "node-a", 7)
    _step(root / "killed-run" / "node-a", 8, manifest=False)
    (root / "killed-run" / "node-b" / "fetch" / "rank0").mkdir(parents=True)
    _step(root / "cut-short" / "n0", 1, manifest=False)
    _step(root / "replica-only" / "n1" / "replicas" / "n0", 4)
    return [dead, root / "killed-run", root / "cut-short", root / "replica-only"]


def test_gc_root_removes_node_memory_only_and_leaves_everything_else(tmp_path, capsys):
    files = _user_files(tmp_path)
    runs = _node_memory(tmp_path)
    live = tmp_path / "live-run"  # claimed by this process: in use
    assert claim(live) is not None and live_owners(live) == [os.getpid()]
    _step(live / "n0", 1)
    rc, out, err = _gc(capsys, "--root", str(tmp_path))
    assert rc == 0, err
    assert f"kept {live}" in out and (live / "n0" / "step-00000001" / "manifest.json").exists(), out
    for f in files:
        assert f.read_text() == "precious", f
    for top in ("myproject", "ckpts", "notes", "odd", "mixed"):
        assert f"{tmp_path / top}: {LEFT}" in out, out
        assert f"removed {tmp_path / top}" not in out
    for run in runs:
        assert not run.exists(), run
        assert f"removed {run} (" in out, out


def test_gc_with_the_memory_root_from_the_environment_leaves_a_users_files(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv(ENV_MEMORY_ROOT, str(tmp_path))
    files = _user_files(tmp_path)
    rc, out, _ = _gc(capsys)
    assert rc == 0 and "removed 0.0 MB in all" in out, out
    assert all(f.read_text() == "precious" for f in files)
    assert f"{tmp_path / 'myproject'}: {LEFT}" in out


def test_gc_run_naming_a_users_directory_leaves_it(tmp_path, capsys):
    files = _user_files(tmp_path)
    rc, out, _ = _gc(capsys, "--root", str(tmp_path), "--run", "myproject")
    assert rc == 0 and f"{tmp_path / 'myproject'}: {LEFT}" in out, out
    assert all(f.read_text() == "precious" for f in files)


@pytest.mark.parametrize(
    "layout, ours",
    [
        ({"n0/step-00000002/manifest.json": "{}"}, True),
        ({".owners/123-456": ""}, True),  # claimed, before any node wrote
        ({"n0/step-00000002.tmp/x": ""}, True),  # a first checkpoint cut short
        ({"n0/replicas/n1/step-00000002/manifest.json": "{}", "n0/fetch/rank0/x": ""}, True),
        ({"n0/step-00000002/manifest.json": "{}", ".owners/x": ""}, False),  # not a claim's name
        ({"n0/step-00000002/manifest.json": "{}", "README": ""}, False),  # a file beside node dirs
        ({"n0/step-00000002/manifest.json": "{}", "n0/config.yaml": ""}, False),
        ({"n0/step-1000/model.pt": ""}, False),  # steps without manifest.json: not a flash checkpoint
        ({"n0/step-12.tmp/x": ""}, False),  # not flash's zero-padded name
        ({"n0/replicas/n1/data.bin": ""}, False),
        ({"src/main.py": ""}, False),
        ({}, False),  # an empty directory: nothing says elastic-rm made it
    ],
)
def test_is_node_memory(tmp_path, layout, ours):
    from elastic_rm.checkpoint.owners import is_node_memory

    run = tmp_path / "run"
    run.mkdir()
    for rel, text in layout.items():
        (run / rel).parent.mkdir(parents=True, exist_ok=True)
        (run / rel).write_text(text)
    assert is_node_memory(run) is ours


def test_gc_removes_a_real_flash_checkpoints_memory_and_not_a_directory_beside_it(tmp_path, capsys):
    """The layout a real flash checkpoint leaves (TorchRec's pipeline, a world of one, no claim: an
    explicit memory root) is node memory; a user's directory beside it is not."""
    pytest.importorskip("torchrec")
    from tests.train.test_prefetch_batches import golden_parts

    root = tmp_path / "root"
    pg = tmp_path / "pg"
    torch_dist = pytest.importorskip("torch.distributed")
    torch_dist.init_process_group("gloo", init_method=f"file://{pg}", rank=0, world_size=1)
    try:
        elastic, pipeline, it = golden_parts(root, [], checkpoint_every=4)
        for _ in elastic.steps(7):
            pipeline.progress(it)
        del pipeline, it, elastic
    finally:
        import gc

        gc.collect()
        torch_dist.destroy_process_group()
    run = root / "mem"  # golden_parts' memory root: <run>/<node>/step-N
    assert any(run.glob("n0/step-*/manifest.json")), sorted(run.rglob("*"))
    files = _user_files(root)
    rc, out, _ = _gc(capsys, "--root", str(root))
    assert rc == 0 and f"removed {run} (" in out and not run.exists(), out
    assert all(f.read_text() == "precious" for f in files)


def test_claims_read_while_their_run_directory_is_removed_are_no_error(tmp_path):
    """An agent's release removes its run directory while `erm gc` (or another agent's thread count)
    reads the claims in it: an existence check before the read raced the removal (FileNotFoundError: once
    in the suite's node-memory test, and here about once in 800 reads). Bounded: 20,000 reads."""
    run = tmp_path / "run"
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            (run / OWNERS).mkdir(parents=True, exist_ok=True)
            (run / OWNERS / "1-2").touch()  # pid 1's claim with a start time it does not have
            shutil.rmtree(run, ignore_errors=True)

    churner = threading.Thread(target=churn)
    churner.start()
    try:
        for _ in range(20_000):
            assert live_owners(run) == []
    finally:
        stop.set()
        churner.join()
