"""The seam between the agent and the rendezvous: a renamed member must fail here, not turn a feature off.

The agent calls NodeServices directly (no lookup by name): these tests check that the implementation has
every member of the Protocol with the same signature, that the agent uses nothing else (of the services,
nor of torch's handler beyond torch's RendezvousHandler API), and what it does with and without services.
"""

from __future__ import annotations

import ast
import inspect
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import registry as torch_registry
from typing_extensions import get_protocol_members

from elastic_rm.rendezvous.node_services import RendezvousNodeServices
from elastic_rm.rendezvous.registration import node_services
from elastic_rm.rendezvous.services import WITHOUT_SERVICES, NodeServices
from tests.rendezvous.test_handler import make

ROOT = Path(__file__).resolve().parents[2]
MEMBERS = sorted(get_protocol_members(NodeServices))


def _mismatches(protocol: type, impl: type) -> list[str]:
    """Why ``impl`` does not implement ``protocol``: each member missing, of the wrong kind (property vs
    method) or with another signature (parameter names, kinds, defaults, annotations, return)."""
    problems = []
    for name in sorted(get_protocol_members(protocol)):
        want = inspect.getattr_static(protocol, name)
        try:
            have = inspect.getattr_static(impl, name)
        except AttributeError:
            problems.append(f"{name}: missing")
            continue
        if isinstance(want, property):
            if not isinstance(have, property):
                problems.append(f"{name}: not a property")
            elif (
                inspect.signature(want.fget).return_annotation
                != inspect.signature(have.fget).return_annotation
            ):
                problems.append(f"{name}: a property of another type")
        elif not inspect.isfunction(have):
            problems.append(f"{name}: not a method")
        elif inspect.signature(want) != inspect.signature(have):
            problems.append(
                f"{name}: signature {inspect.signature(have)}, expected {inspect.signature(want)}"
            )
    return problems


def test_the_checker_finds_a_renamed_a_changed_and_a_retyped_member():
    renamed = type("Renamed", (), {k: v for k, v in vars(RendezvousNodeServices).items() if k != "release"})
    assert _mismatches(NodeServices, renamed) == ["release: missing"]

    def publish_metrics(self, record: dict) -> None: ...

    changed = type("Changed", (RendezvousNodeServices,), {"publish_metrics": publish_metrics})
    assert [p.split(":")[0] for p in _mismatches(NodeServices, changed)] == ["publish_metrics"]
    retyped = type("Retyped", (RendezvousNodeServices,), {"lease_ttl": 5.0})
    assert _mismatches(NodeServices, retyped) == ["lease_ttl: not a property"]


def test_the_rendezvous_implements_every_member_of_node_services():
    assert MEMBERS, "NodeServices declares no member"
    assert _mismatches(NodeServices, RendezvousNodeServices) == []


def _attributes_used(path: Path, owner: str) -> set[str]:
    """Attributes read off a name ``owner`` or an attribute ``<x>.<owner>`` in ``path``."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute):
            value = node.value
            if (isinstance(value, ast.Name) and value.id == owner) or (
                isinstance(value, ast.Attribute) and value.attr == owner
            ):
                used.add(node.attr)
    return used


@pytest.mark.parametrize(
    "module",
    [
        "agent/agent.py",
        "agent/entry.py",
        "agent/ckpt_hooks.py",
        "checkpoint/server.py",
        "agent/inplace.py",
        "agent/ledger_mirror.py",
        "agent/prepared.py",
        "agent/stop.py",
    ],
)
def test_the_agent_uses_only_declared_members(module):
    """Of the services only NodeServices' members; of the handler only torch's RendezvousHandler API."""
    path = ROOT / "elastic_rm" / module
    services = _attributes_used(path, "services") | _attributes_used(path, "_services")
    assert services <= set(MEMBERS), f"{module} uses undeclared services: {services - set(MEMBERS)}"
    handler = _attributes_used(path, "handler") | _attributes_used(path, "_handler")
    handler |= _attributes_used(path, "rdzv_handler")
    torch_api = {n for n in vars(RendezvousHandler) if not n.startswith("_")}
    assert handler <= torch_api, f"{module} uses the handler beyond torch's API: {handler - torch_api}"


def _agent(handler: RendezvousHandler, services, tmp_path):
    from elastic_rm.agent.agent import ElasticRMAgent

    spec = WorkerSpec(role="trainer", local_world_size=1, rdzv_handler=handler, entrypoint="true", args=())
    return ElasticRMAgent(spec=spec, services=services, logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))


def test_under_torchs_own_backend_the_agent_gets_none_and_says_what_it_runs_without(tmp_path, caplog):
    params = RendezvousParameters("static", "127.0.0.1:29999", "r", 1, 1, rank=0)
    handler = torch_registry.get_rendezvous_handler(params)
    assert node_services(handler) is None
    with caplog.at_level(logging.WARNING, logger="elastic_rm.agent.agent"):
        agent = _agent(handler, None, tmp_path)
    try:
        assert f"backend 'static' has no elastic-rm node services; running without {WITHOUT_SERVICES}" in (
            caplog.text
        )
        assert agent.ckpt_server is None and agent.ledger_mirror is None and agent.joined_round is None
        assert agent.membership_grace() == 0.0
    finally:
        agent.close()


def test_an_elastic_rm_handler_gives_the_agent_its_services(etcd, run_id, tmp_path, caplog):
    h = make(etcd, run_id, 1, 1, node_id="n0", lease_ttl="3")
    services = node_services(h)
    assert services is h.services and isinstance(services, RendezvousNodeServices)
    agent = None
    try:
        with caplog.at_level(logging.WARNING, logger="elastic_rm.agent.agent"):
            agent = _agent(h, services, tmp_path)
        assert "no elastic-rm node services" not in caplog.text
        assert agent.ckpt_server is not None and agent.ckpt_server.host == services.addr == "127.0.0.1"
        assert agent.ledger_mirror is not None and agent.membership_grace() == 4.0  # lease TTL + 1 s
        assert agent.joined_round is None and services.checkpoint_peers() == {}  # before the first round
        info = h.next_rendezvous()
        assert (info.rank, info.world_size) == (0, 1)
        assert agent.joined_round is not None and agent.joined_round.members == ("n0",)
        assert services.node_id == agent.node_id == "n0" and services.events is agent.events
        assert not services.peers_all_kept()  # no pending round
    finally:
        if agent is not None:
            agent.close()
        services.release()
    services.publish_metrics(b"{}")  # after release: nothing is written, nothing raises
    with pytest.raises(RendezvousClosedError):
        h.next_rendezvous()


@pytest.mark.parametrize(  # a new interpreter each (~4 s): CI keeps one, test_plugin_registration.py others
    "first", ["elastic_rm.wire.records", pytest.param("elastic_rm.agent.agent", marks=pytest.mark.slow)]
)
def test_torch_loads_the_plugin_whatever_module_comes_first(first):
    """torch loads its ``torchrun.handlers`` plugins while elastic-rm's own modules import torch: the
    plugin's module (registration.py) must then import without the modules that are still loading."""
    from importlib.metadata import entry_points

    if not any(ep.name == "elastic-rm" for ep in entry_points(group="torchrun.handlers")):
        pytest.skip("the package's entry points are not installed (running from a source tree)")
    code = (
        f"import {first}\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as r\n"
        "print('elastic-rm' in r._registry)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "out of tree plugin" not in out.stderr, out.stderr
    assert out.stdout.strip() == "True"
