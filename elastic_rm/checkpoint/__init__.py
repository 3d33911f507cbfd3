"""Flash checkpoint: in-memory snapshots written into node memory in the background, replicated to a peer
node's checkpoint server and persisted durably, and restored into any world size (docs/train.md).

The checkpoint sits below training (``elastic_rm.train`` uses it, never the other way round); the agent
runs its checkpoint server. Names are imported lazily, so the agent's and the reporter's light modules do
not pay for torchrec.
"""

from __future__ import annotations

from ..lazy_exports import lazy_getattr

_EXPORTS = {
    "FlashCheckpointer": "flash",
    "FlashConfig": "flash",
    "SaveStats": "flash",
    "CorruptCheckpointError": "manifest",
    "RestoreResult": "restore",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr(__name__, _EXPORTS)
