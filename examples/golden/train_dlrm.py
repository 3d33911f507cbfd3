#!/usr/bin/env python3
"""TorchRec's golden DLRM training script (examples/golden_training/train_dlrm.py), made elastic.

The same parts in the same order: a DLRM over the 26 Criteo categorical features with a row-wise
Adagrad fused into the backward pass, an EmbeddingBagCollectionSharder (quantized comms on NCCL),
DistributedModelParallel, a KeyedOptimizerWrapper'd Adagrad for the dense part, TrainPipelineSparseDist
and a tqdm loop over random batches. The lines that make it elastic are marked `# elastic:`;
docs/train.md ("Porting TorchRec's golden train_dlrm.py") lists them with why. The command line only
sets `train()`'s arguments (the golden script has none; its defaults are the golden ones).

    ermrun --nnodes 1:4 --nproc-per-node 2 examples/golden/train_dlrm.py --num-embeddings 100000
"""

import argparse
import os

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES, DEFAULT_INT_NAMES
from torchrec.distributed import TrainPipelineSparseDist
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
from tqdm import tqdm

from elastic_rm.train import (  # elastic:
    ElasticTraining,
    IndexedRandomRecDataset,
    WorldTopology,
    elastic_run,
    plan_sharding,
)


def _get_random_dataset(num_embeddings: int, batch_size: int = 32) -> IndexedRandomRecDataset:
    # elastic: RandomRecDataset's arguments, its batches addressed by sample index (the sample ledger)
    return IndexedRandomRecDataset(
        keys=DEFAULT_CAT_NAMES,
        batch_size=batch_size,
        hash_size=num_embeddings,
        ids_per_feature=1,
        num_dense=len(DEFAULT_INT_NAMES),
    )


@record
def main() -> None:
    args = parse_args()
    # elastic: train() once per round, inside it: planned rounds and a lost peer keep this process
    elastic_run(lambda: train(**vars(args)))


def train(
    num_embeddings: int = 1024**2,
    embedding_dim: int = 128,
    dense_arch_layer_sizes: list[int] | None = None,
    over_arch_layer_sizes: list[int] | None = None,
    learning_rate: float = 0.1,
    num_iterations: int = 1000,
    qcomm_forward_precision: CommType | None = CommType.FP16,
    qcomm_backward_precision: CommType | None = CommType.BF16,
    global_batch_size: int = 48,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 20,
) -> None:
    """Build a DLRM, shard it over the ranks of this round and train it on random batches; every rank
    runs this (SPMD). Quantized comms (qcomm_*) apply on NCCL only, as in the golden script."""
    if dense_arch_layer_sizes is None:
        dense_arch_layer_sizes = [64, embedding_dim]
    if over_arch_layer_sizes is None:
        over_arch_layer_sizes = [64, 1]

    # device and backend (elastic: the process group is initialised by elastic_run())
    rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device: torch.device = torch.device(f"cuda:{rank}")
        backend = "nccl"
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        backend = "gloo"

    torch.manual_seed(0)  # elastic: the same initial state in a replay (tests compare bit for bit)
    # the DLRM, its tables built on meta (DMP materialises each rank's shards)
    eb_configs = [
        EmbeddingBagConfig(
            name=f"t_{feature_name}",
            embedding_dim=embedding_dim,
            num_embeddings=num_embeddings,
            feature_names=[feature_name],
        )
        for feature_name in DEFAULT_CAT_NAMES
    ]
    dlrm_model = DLRM(
        embedding_bag_collection=EmbeddingBagCollection(tables=eb_configs, device=torch.device("meta")),
        dense_in_features=len(DEFAULT_INT_NAMES),
        dense_arch_layer_sizes=dense_arch_layer_sizes,
        over_arch_layer_sizes=over_arch_layer_sizes,
        dense_device=device,
    )
    train_model = DLRMTrain(dlrm_model)

    apply_optimizer_in_backward(
        RowWiseAdagrad,
        train_model.model.sparse_arch.parameters(),
        {"lr": learning_rate},
    )
    qcomm_codecs_registry = (
        get_qcomm_codecs_registry(
            qcomms_config=QCommsConfig(
                forward_precision=qcomm_forward_precision,
                backward_precision=qcomm_backward_precision,
            )
        )
        if backend == "nccl"
        else None
    )
    sharder = EmbeddingBagCollectionSharder(qcomm_codecs_registry=qcomm_codecs_registry)
    # elastic: a plan for this round's world under the rules that keep a resharded restore exact
    plan = plan_sharding(train_model, WorldTopology.from_env(), sharders=[sharder])

    model = DistributedModelParallel(
        module=train_model,
        device=device,
        sharders=[sharder],
        plan=plan,  # elastic
    )

    non_fused_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    # overlaps the input distribution of the next batch with this one's compute
    train_pipeline = TrainPipelineSparseDist(
        model,
        non_fused_optimizer,
        device,
    )

    # elastic: flash checkpoint, restore, sample ledger and the agent's drain
    elastic = ElasticTraining(
        model,
        plan,
        non_fused_optimizer,
        global_batch=global_batch_size,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=checkpoint_every,
    )
    # train
    train_iterator = elastic.batches(  # elastic: the ledger's batches, read ahead by the pipeline
        _get_random_dataset(
            num_embeddings=num_embeddings,
        )
    )
    for _ in tqdm(elastic.steps(num_iterations), mininterval=5.0):  # elastic: from the restored step
        train_pipeline.progress(train_iterator)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-embeddings", type=int, default=1024**2, help="rows per table")
    p.add_argument("--embedding-dim", type=int, default=128)
    p.add_argument("--dense-arch-layer-sizes", type=int, nargs="+", default=None)
    p.add_argument("--over-arch-layer-sizes", type=int, nargs="+", default=None)
    p.add_argument("--learning-rate", type=float, default=0.1)
    p.add_argument("--num-iterations", type=int, default=1000, help="train until this global step")
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=48,
        help="samples per step over all ranks (fixed; every world --nnodes allows must divide it)",
    )
    p.add_argument("--checkpoint-dir", default=None, help="durable checkpoints (shared by all nodes)")
    p.add_argument("--checkpoint-every", type=int, default=20, help="flash checkpoint every n steps")
    return p.parse_args()


if __name__ == "__main__":
    main()
