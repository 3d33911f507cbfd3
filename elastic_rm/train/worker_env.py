"""What a worker reads about its place in the world without importing torch on its own."""

from __future__ import annotations

import os
import sys
from typing import Any


def env_int(name: str) -> int:
    """An integer environment variable (RANK, LOCAL_RANK); -1 when unset or not a number."""
    try:
        return int(os.environ.get(name, "-1"))
    except ValueError:
        return -1


def world_size(group: Any) -> int:
    """The process group's size; 1 when torch.distributed is not imported or not initialised."""
    dist = sys.modules.get("torch.distributed")  # never import torch on our own
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return int(dist.get_world_size(group))
