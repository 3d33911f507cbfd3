"""Pins the private torch methods ElasticRMAgent overrides, so a torch upgrade that changes them fails here
instead of silently skipping our hooks."""

from __future__ import annotations

import inspect

import torch
from torch.distributed.elastic.agent.server.api import RunResult, SimpleElasticAgent, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.utils import store as store_util

from elastic_rm.agent.agent import ElasticRMAgent


def test_torch_version_is_the_pinned_one():
    assert torch.__version__.split("+")[0] == "2.13.0", (
        "re-check the overridden private methods below, then update the pin"
    )


def test_overridden_methods_still_exist_with_the_same_signature():
    expected = {
        "_monitor_workers": ["self", "worker_group"],
        "_start_workers": ["self", "worker_group"],
        "_restart_workers": ["self", "worker_group"],
        "_exit_barrier": ["self"],
    }
    for name, params in expected.items():
        method = getattr(LocalElasticAgent, name)
        assert list(inspect.signature(method).parameters) == params, name
        assert getattr(ElasticRMAgent, name) is not method, f"ElasticRMAgent no longer overrides {name}"


def test_invoke_run_still_restarts_on_waiting_nodes_without_using_a_restart():
    # Our lost-peer handling returns HEALTHY from _monitor_workers so that this branch runs.
    source = inspect.getsource(SimpleElasticAgent._invoke_run)
    assert "num_nodes_waiting()" in source and "_restart_workers" in source
    assert "WorkerState.HEALTHY" in source
    assert RunResult(state=WorkerState.HEALTHY).state == WorkerState.HEALTHY


def test_the_exit_barrier_is_still_torchs_store_barrier_with_the_same_attributes():
    # elastic_rm.agent.finish reimplements _exit_barrier over the same store keys and attributes
    source = inspect.getsource(SimpleElasticAgent._exit_barrier)
    for name in (
        "store_util.barrier",
        "_TERMINAL_STATE_SYNC_ID",
        "_exit_barrier_timeout",
        "_in_exit_barrier",
    ):
        assert name in source, name
    barrier = inspect.getsource(store_util._barrier_nonblocking)
    assert "store.add(num_members_key, 1)" in barrier and store_util._NUM_MEMBERS == "/num_members"
