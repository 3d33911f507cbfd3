"""Worker functions of the conformance scenarios (module level: spawned workers import them)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def dist_sum() -> int:
    """All-reduce the ranks over gloo; fails unless every rank of the world took part."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group(backend="gloo")
    try:
        t = torch.tensor(rank)
        dist.all_reduce(t)
        if int(t.item()) != sum(range(world)):
            raise RuntimeError(f"rank sum {int(t.item())}, expected {sum(range(world))}")
        return int(t.item())
    finally:
        dist.destroy_process_group()


def role_info() -> tuple[int, int, int, int, int]:
    """(rank, role rank, group rank, role world size, world size) as the agent set them."""
    keys = ("RANK", "ROLE_RANK", "GROUP_RANK", "ROLE_WORLD_SIZE", "WORLD_SIZE")
    return tuple(int(os.environ[k]) for k in keys)  # type: ignore[return-value]


def rank_or_fail() -> int:
    """Odd ranks fail: the run's failure must reach every agent."""
    rank = int(os.environ["RANK"])
    if rank % 2:
        raise RuntimeError(f"rank {rank} fails on purpose")
    return rank


def _drift(fail: bool) -> int:
    """Nodes finish apart (group rank 1 sleeps 2 s): the exit barrier holds the early node for the late
    one; with ``fail`` the late node's workers fail after their sleep."""
    import time

    if int(os.environ["GROUP_RANK"]) == 1:
        time.sleep(2)
        if fail:
            raise RuntimeError("the late node fails on purpose")
    return int(os.environ["RANK"])


def drift_success() -> int:
    return _drift(False)


def drift_fail() -> int:
    return _drift(True)


def touch_rank(directory: str) -> int:
    """Leave a file named after this worker's global rank (torch's launcher tests do the same)."""
    rank = int(os.environ["RANK"])
    with open(os.path.join(directory, f"{rank}-of-{os.environ['WORLD_SIZE']}"), "w"):
        pass
    return rank
