"""Flash checkpoint: in-memory snapshots written into node memory in the background, replicated to a peer
node's checkpoint server and persisted durably, and restored into any world size (docs/train.md).

The checkpoint sits below training (``elastic_rm.train`` uses it, never the other way round); the agent
runs its checkpoint server. Names are imported lazily, so the agent's and the reporter's light modules do
not pay for torchrec.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FlashCheckpointer": "flash",
    "FlashConfig": "flash",
    "SaveStats": "flash",
    "CorruptCheckpointError": "manifest",
    "RestoreResult": "restore",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_rm.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f"elastic_rm.checkpoint.{module}"), name)
