"""What a finished round leaves behind in a worker kept across rounds (elastic_rm.train.round_memory)."""

from __future__ import annotations

import gc
import json
import linecache
import logging
import subprocess
import sys
import weakref

import torch
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.distributed.optim import apply_optimizer_in_backward as aob

from elastic_rm.train.round_memory import release_round_memory


def _meta_round() -> weakref.ref:
    """One round's unsharded embedding table as the example declares it: a meta parameter with its
    fused optimizer applied in backward (the sharder reads it); returns a weak reference to it."""
    table = torch.nn.Parameter(torch.empty(1000, 16, device="meta"))
    _apply_optimizer_in_backward(torch.optim.Adagrad, [table], {"lr": 0.1})
    return weakref.ref(table)


def test_meta_parameters_of_old_rounds_are_freed_and_live_ones_keep_their_optimizer():
    live = torch.nn.Parameter(torch.ones(4))
    _apply_optimizer_in_backward(torch.optim.SGD, [live], {"lr": 0.5})
    old = [_meta_round() for _ in range(3)]
    gc.collect()
    # torch's weak-keyed maps keep them: the gradient accumulator (the value) holds its parameter (the key)
    assert all(r() is not None for r in old)

    release_round_memory()

    assert all(r() is None for r in old), "the old rounds' meta parameters must be collected"
    assert live in aob.param_to_acc_grad_map and live in aob.param_to_optim_hook_handle_map
    (live * 2).sum().backward()  # the in-backward optimizer still steps the live parameter
    assert torch.allclose(live.detach(), torch.zeros(4))


OPTIM_IN_BACKWARD = "torch.distributed.optim.apply_optimizer_in_backward"


def test_release_without_torch_optim_loaded_neither_fails_nor_imports_it():
    """In a process of its own: this test module has imported torch's in-backward optimizer already."""
    script = (
        "import json, sys\n"
        "from elastic_rm.train.round_memory import release_round_memory\n"
        f"before = {OPTIM_IN_BACKWARD!r} in sys.modules\n"
        "release_round_memory()\n"
        f"print(json.dumps([before, {OPTIM_IN_BACKWARD!r} in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [False, False]  # not loaded before (the premise), nor by the release


def test_release_twice_is_harmless_and_keeps_live_parameters():
    assert OPTIM_IN_BACKWARD in sys.modules  # the other case: torch's table is there
    live = torch.nn.Parameter(torch.ones(4))
    _apply_optimizer_in_backward(torch.optim.SGD, [live], {"lr": 0.5})
    release_round_memory()
    release_round_memory()
    assert live in aob.param_to_acc_grad_map and live in aob.param_to_optim_hook_handle_map


def test_a_held_failure_leaves_no_source_lines_cached(caplog):
    from elastic_rm.train.rounds import Round

    linecache.clearcache()
    rnd = Round(1, 7, 0, 2, can_wait=True)
    with caplog.at_level(logging.WARNING, logger="elastic_rm.train.rounds"):
        with rnd:
            raise RuntimeError("a peer is gone")
    assert rnd.failure == ["RuntimeError: a peer is gone"]
    assert "Traceback" in caplog.text and "a peer is gone" in caplog.text  # the log still has it
    assert linecache.cache == {}, f"source lines cached by the log line: {sorted(linecache.cache)}"
