"""How many glibc malloc arenas the workers and warm spares use: one, unless told otherwise.

A worker kept across rounds allocates on several threads (its checkpoint writer, gloo's, torch's), and
glibc gives a thread that finds the heap busy an arena of its own (up to 8 per core). Memory freed in an
arena stays with that arena, so a kept worker held tens of MiB of free heap in a second arena after its
first rounds, and its resident memory grew round after round in place (benchmarks/recovery/memory; the
figures are in docs/benchmarks.md). With one arena every thread reuses what another freed.

glibc reads ``MALLOC_ARENA_MAX`` once, when a process starts. The agent sets it in its own environment,
which its spares and workers inherit (its own heap is already set up and keeps glibc's default). A
``MALLOC_ARENA_MAX`` already in the environment wins.
"""

from __future__ import annotations

import os

ENV = "MALLOC_ARENA_MAX"
DEFAULT_ARENAS = 1


def set_worker_arenas(arenas: int) -> str | None:
    """Give the processes this agent starts ``arenas`` malloc arenas (0: glibc's default). Returns the
    value they get (None: glibc's default), which may be the user's own."""
    if ENV not in os.environ and arenas:
        os.environ[ENV] = str(arenas)
    return os.environ.get(ENV)
