"""Give back what a finished round held, so that a worker kept across rounds does not grow round by round.

Why: a worker in :func:`elastic_rm.train.rounds.rounds` builds a new model, sharding and optimizer every
round. Three things outlive the old round unless told otherwise (benchmarks/recovery/memory measured them):
- torch's ``_apply_optimizer_in_backward`` (which TorchRec's ``apply_optimizer_in_backward`` calls) keeps
  each parameter's gradient accumulator in a module-level ``WeakTensorKeyDictionary``; the accumulator
  holds its parameter, so the weak key never dies, and every round's unsharded (meta) embedding
  parameters stay, with their optimizers and hooks;
- glibc keeps the heap that the old round's model, restore buffers and process groups freed, so the RSS
  keeps the high-water mark of every round change. ``malloc_trim`` returns it to the system, at the
  round's end and again after the new round's first step (its build and restore freed their buffers).
  Not a fixed mmap threshold (``mallopt``) instead: with large blocks mapped and unmapped on their own,
  every tensor op's temporaries of 128 KiB or more cost an order of magnitude more (page faults and
  unmapping per block), and the rounds' restore and checksum phases slowed with them.
- A held failure's log line formats its traceback, which caches the source of every file in it
  (``linecache``, about 1 MiB per lost member); :func:`forget_new_source_lines` drops what it added.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import linecache
import sys
from collections.abc import Iterator
from contextlib import contextmanager


def release_round_memory() -> None:
    """Drop the in-backward optimizer entries of meta parameters (placeholders that declared the fused
    optimizer to the sharder: they never train), collect, and return freed heap to the system."""
    _drop_meta_in_backward_optimizers()
    gc.collect()
    trim_heap()


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


@contextmanager
def forget_new_source_lines() -> Iterator[None]:
    """Drop the ``linecache`` entries that the block adds (a logged traceback's source files)."""
    cached = set(linecache.cache)
    try:
        yield
    finally:
        for name in set(linecache.cache) - cached:
            linecache.cache.pop(name, None)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc (it has ``malloc_trim``); looked up once: ``find_library`` runs
    ``ldconfig`` in a subprocess, and the heap is trimmed twice a round."""
    name = ctypes.util.find_library("c")
    if name is None or not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - glibc only (musl has none)
    except (OSError, AttributeError):
        return None
    return libc


def trim_heap() -> None:
    """Return the heap's free pages to the system (glibc's ``malloc_trim``; elsewhere nothing)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
