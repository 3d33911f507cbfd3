"""Worker side of elastic TorchRec: sharding for the world at hand, flash checkpoint with resharding
restore, exactly-once dynamic data sharding. See docs/train.md.

The flash checkpoint's names come from :mod:`elastic_rm.checkpoint`, the package below this one.
Names are imported lazily, so `import elastic_rm.train.<light module>` does not pay for torchrec.
"""

from __future__ import annotations

from ..lazy_exports import lazy_getattr

_EXPORTS = {
    "FlashCheckpointer": "elastic_rm.checkpoint.flash",
    "FlashConfig": "elastic_rm.checkpoint.flash",
    "SaveStats": "elastic_rm.checkpoint.flash",
    "CorruptCheckpointError": "elastic_rm.checkpoint.manifest",
    "RestoreResult": "elastic_rm.checkpoint.restore",
    "ElasticPlanError": "sharding",
    "ElasticRules": "sharding",
    "WorldTopology": "sharding",
    "check_plan_agreement": "sharding",
    "plan_sharding": "sharding",
    "plan_summary": "elastic_rm.checkpoint.plan_record",
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


__getattr__ = lazy_getattr(__name__, _EXPORTS)
