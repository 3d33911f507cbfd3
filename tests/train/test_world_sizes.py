"""A fixed global batch is checked against every world size `--nnodes MIN:MAX` x `--nproc-per-node`
allows, at the first round (ElasticTraining), with the world that fails and the values that work."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from elastic_rm.train.pipeline import ElasticTraining
from elastic_rm.train.world_sizes import ENV_NNODES, check_global_batch, possible_worlds


def test_possible_worlds_are_every_node_count_times_the_workers_per_node():
    assert possible_worlds(4, {ENV_NNODES: "2:4", "LOCAL_WORLD_SIZE": "2"}) == [4, 6, 8]
    assert possible_worlds(3, {}) == [3]  # plain torchrun: the world at hand only
    assert possible_worlds(3, {ENV_NNODES: "x", "LOCAL_WORLD_SIZE": "1"}) == [3]


def test_a_batch_every_world_divides_passes_and_one_that_a_world_cannot_is_refused_naming_it():
    check_global_batch(60, 2, {ENV_NNODES: "1:3", "LOCAL_WORLD_SIZE": "2"})  # worlds 2, 4, 6
    with pytest.raises(ValueError) as err:
        check_global_batch(64, 2, {ENV_NNODES: "1:3", "LOCAL_WORLD_SIZE": "2"})
    text = str(err.value)
    assert "a world of 6 workers" in text and "--nnodes 1:3 x --nproc-per-node 2" in text, text
    assert "multiples of 12, e.g. 60 or 72" in text, text
    with pytest.raises(ValueError, match="positive int"):
        check_global_batch(0, 1, {})


def test_elastic_training_refuses_it_at_the_first_round(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_NNODES, "1:3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:  # a world of 1 now, which 64 divides: the check is about the worlds to come
        with pytest.raises(ValueError, match="a world of 3 workers"):
            ElasticTraining(None, None, None, global_batch=64)
    finally:
        dist.destroy_process_group()
