"""Fixtures of the Slurm tests: a real local Slurm cluster (tests/slurm/cluster.py), one per session."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.slurm.cluster import SlurmCluster, why_not

REQUIRE_SLURM_ENV = (
    "ERM_REQUIRE_SLURM"  # "1": a machine that cannot run the cluster fails instead of skipping
)
NODES = 6


@pytest.fixture(scope="session")
def slurm_cluster() -> Iterator[SlurmCluster]:
    reason = why_not()
    if reason is not None:
        if os.environ.get(REQUIRE_SLURM_ENV) == "1":
            pytest.fail(
                f"{reason} (${REQUIRE_SLURM_ENV}=1: this machine was expected to run the Slurm tests)"
            )
        pytest.skip(reason)
    with SlurmCluster(NODES) as cluster:
        yield cluster


@pytest.fixture
def slurm(slurm_cluster: SlurmCluster) -> Iterator[SlurmCluster]:
    """The session's cluster with no job left and every node back in service after the test."""
    yield slurm_cluster
    slurm_cluster.reset()
