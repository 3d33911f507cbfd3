"""The example's sharding plan is made with TorchRec's GreedyProposer alone (it is made again at every
round in place, and the default proposers take about three times as long): for the example's model it
must be the very plan the default proposers give, at every world size a run of it may see."""

from __future__ import annotations

import logging

import pytest
import torch
import torchrec.optim as trec_optim
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner.proposers import GreedyProposer
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from elastic_rm.checkpoint.plan_record import plan_digest, plan_summary
from elastic_rm.train import WorldTopology, plan_sharding


def _example_model() -> DLRMTrain:
    """examples/dlrm/train.py's build_model with its defaults (8 tables of 20,000 x 16)."""
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=16, num_embeddings=20_000, feature_names=[f"cat_{i}"])
        for i in range(8)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=13,
            dense_arch_layer_sizes=[32, 16],
            over_arch_layer_sizes=[32, 1],
            dense_device=torch.device("cpu"),
        )
    )
    apply_optimizer_in_backward(trec_optim.RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": 0.05})
    return model


@pytest.mark.parametrize(("world", "local"), [(1, 1), (2, 1), (3, 1), (4, 1), (4, 2), (6, 2)])
def test_greedy_gives_the_default_plan_for_the_example(world, local):
    topology = WorldTopology(world, local)
    default = plan_sharding(_example_model(), topology, check_same_on_all_ranks=False)
    greedy = plan_sharding(
        _example_model(), topology, check_same_on_all_ranks=False, proposer=GreedyProposer()
    )
    assert plan_summary(greedy) == plan_summary(default)
    assert plan_digest(greedy) == plan_digest(default)
    ranks = {s[4] for tables in plan_summary(greedy).values() for t in tables.values() for s in t["shards"]}
    assert ranks <= set(range(world))  # a plan for this world


def test_planning_says_nothing_about_a_directly_built_topology(caplog):
    """The project's own planning call builds TorchRec's Topology through its factory: no warning that
    "the job will fail" at every round."""
    with caplog.at_level(logging.WARNING):
        plan_sharding(
            _example_model(), WorldTopology(2, 1), check_same_on_all_ranks=False, proposer=GreedyProposer()
        )
    assert not [r for r in caplog.records if "job will fail" in r.getMessage()], caplog.text
