"""The touched-row tracker's bookkeeping, on a stand-in sharded module (a class whose name says Sharded,
with TorchRec's table configs and its two methods): what a save takes when a batch's input went out but
was never computed, and two trackers on one model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torchrec import KeyedJaggedTensor

from elastic_rm.checkpoint.delta_tracker import TouchedRows
from tests.train.test_prefetch_batches import world_of_one  # noqa: F401 - a fixture

KEY = "bags.embedding_bags.t0.weight"


@dataclass
class TableConfig:
    name: str
    num_embeddings: int
    feature_names: list[str] = field(default_factory=list)


class ShardedBags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self._embedding_bag_configs = [TableConfig("t0", 100, ["f0"])]

    def input_dist(self, ctx, features):
        return features

    def compute_and_output_dist(self, ctx, features):
        return features


def model() -> nn.Module:
    m = nn.Module()
    m.add_module("bags", ShardedBags())
    return m


def batch(*ids: int) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)])
    )


def test_a_batch_sent_but_never_computed_does_not_hide_the_next_ones_rows(world_of_one):  # noqa: F811
    m = model()
    tracker = TouchedRows(m)
    m.bags.input_dist(None, batch(1, 2))  # its compute never comes (a pipeline dropped mid-stream)
    m.bags.input_dist(None, batch(5, 6))
    m.bags.compute_and_output_dist(None, batch(5, 6))  # consumes the oldest pending batch: 1, 2
    taken = tracker.take()[KEY].tolist()
    assert {1, 2, 5, 6} <= set(taken), taken
    m.bags.input_dist(None, batch(9))
    m.bags.compute_and_output_dist(None, batch(9))
    assert {5, 6, 9} <= set(tracker.take()[KEY].tolist())  # still pending ones count again, never lost
    tracker.detach()


def test_detaching_a_later_tracker_leaves_the_earlier_one_recording(world_of_one):  # noqa: F811
    m = model()
    first = TouchedRows(m)
    second = TouchedRows(m)
    second.detach()
    m.bags.input_dist(None, batch(7))
    m.bags.compute_and_output_dist(None, batch(7))
    assert first.take()[KEY].tolist() == [7]
    first.detach()
    assert "input_dist" not in m.bags.__dict__ and "compute_and_output_dist" not in m.bags.__dict__
