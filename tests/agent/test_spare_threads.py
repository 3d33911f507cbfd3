"""A worker started from a warm spare gets the round's ``OMP_NUM_THREADS`` in its preloaded torch. The
OpenMP runtime reads the variable once, when ``import torch`` loads it: in the spare, before torch's
launcher (1 per worker by default) or the agent set it, so such a worker ran its intra-op parallelism on
every core while a new process honoured the variable. A stand-in ``torch`` (preloaded from PYTHONPATH)
records the call; the real one was checked by hand: ``torch.get_num_threads()`` was the core count, now 1.
"""

from __future__ import annotations

import os

import pytest

from elastic_rm.agent.spares import SparePool
from elastic_rm.guard import Watchdog

FAKE_TORCH = """
threads = None
def set_num_threads(n):
    global threads
    threads = n
"""
SCRIPT = "import torch\nprint('threads', torch.threads)\n"


@pytest.fixture
def fake_torch_pool(tmp_path, monkeypatch):
    lib = tmp_path / "lib"
    (lib / "torch").mkdir(parents=True)
    (lib / "torch" / "__init__.py").write_text(FAKE_TORCH)
    monkeypatch.setenv("PYTHONPATH", str(lib))  # the spare starts with this environment, as the agent's
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    guard = Watchdog()
    pool = SparePool(("torch",), guard)
    yield pool
    pool.close()
    guard.release()


@pytest.mark.parametrize("value, expected", [("1", "1"), ("3,2", "3"), (None, "None"), ("x", "None")])
def test_the_rounds_omp_num_threads_reaches_the_preloaded_torch(fake_torch_pool, tmp_path, value, expected):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    fake_torch_pool.fill(1, low_priority=False)
    spare = fake_torch_pool.take()
    assert spare is not None
    env = dict(os.environ) | ({} if value is None else {"OMP_NUM_THREADS": value})
    out = tmp_path / "out.log"
    with open(out, "w") as stream:
        spare.hand([str(script)], env, stream, stream)
    assert spare.proc.wait(30) == 0, out.read_text()
    assert f"threads {expected}" in out.read_text()
