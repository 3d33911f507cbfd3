"""Give back what a finished round held, so that a worker kept across rounds does not grow round by round.

Why: a worker in :func:`elastic_rm.train.rounds.rounds` builds a new model, sharding and optimizer every
round. Two things outlive the old round unless told otherwise (benchmarks/recovery/memory measured both):
- torch's ``_apply_optimizer_in_backward`` (which TorchRec's ``apply_optimizer_in_backward`` calls) keeps
  each parameter's gradient accumulator in a module-level ``WeakTensorKeyDictionary``; the accumulator
  holds its parameter, so the weak key never dies, and every round's unsharded (meta) embedding
  parameters stay, with their optimizers and hooks;
- glibc keeps the heap that the old round's model, restore buffers and process groups freed, so the RSS
  keeps the high-water mark of every round change. ``malloc_trim`` returns it to the system.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import sys


def release_round_memory() -> None:
    """Drop the in-backward optimizer entries of meta parameters (placeholders that declared the fused
    optimizer to the sharder: they never train), collect, and return freed heap to the system."""
    _drop_meta_in_backward_optimizers()
    gc.collect()
    _malloc_trim()


def _drop_meta_in_backward_optimizers() -> None:
    module = sys.modules.get("torch.distributed.optim.apply_optimizer_in_backward")
    if module is None:
        return
    for name in ("param_to_acc_grad_map", "param_to_optim_hook_handle_map"):
        table = getattr(module, name, None)
        if table is None:
            continue
        for param in [p for p in list(table.keys()) if getattr(p, "is_meta", False)]:
            handles = table.pop(param, None)
            for handle in handles if isinstance(handles, list) else ():
                handle.remove()


def _malloc_trim() -> None:
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return
    trim(0)
