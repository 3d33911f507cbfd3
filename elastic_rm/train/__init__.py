"""Worker side of elastic TorchRec: sharding for the world at hand, flash checkpoint with resharding
restore, exactly-once dynamic data sharding. See docs/train.md.

Names are imported lazily, so `import elastic_rm.train.<light module>` does not pay for torchrec.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "FlashCheckpointer": "checkpoint",
    "FlashConfig": "checkpoint",
    "SaveStats": "checkpoint",
    "CorruptCheckpointError": "manifest",
    "RestoreResult": "restore",
    "ElasticPlanError": "sharding",
    "ElasticRules": "sharding",
    "WorldTopology": "sharding",
    "check_plan_agreement": "sharding",
    "plan_sharding": "sharding",
    "plan_summary": "sharding",
    "wrap_model": "sharding",
    "dense_parameters": "sharding",
    "RangeLedger": "ledger",
    "DataRange": "ledger",
    "GlobalBatches": "ledger",
    "JsonFileLedgerStore": "ledger",
    "EtcdLedgerStore": "ledger_etcd",
    "SyntheticClickData": "data",
    "CriteoTSVReader": "data",
    "IndexedRandomRecDataset": "random_data",
    "ElasticTraining": "pipeline",
    "LedgerIterator": "pipeline",
    "elastic_rounds": "pipeline",
    "elastic_run": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic_rm.train' has no attribute {name!r}")
    return getattr(importlib.import_module(f"elastic_rm.train.{module}"), name)
