"""The netns harness itself: a network whose owner died without its cleanup is removed by the next one, and
a new network never takes a subnet that an address here already uses (a leaked bridge with the same
subnet kept its route, and every host of the new network timed out reaching etcd)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.netns.hosts import Network, _free_subnet, _ip, remove_leaked_networks, why_unavailable

UNAVAILABLE = why_unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

LEAKER = """
import json, os, signal
from tests.netns.hosts import Network
net = Network(2).__enter__()
print(json.dumps({"bridge": net.bridge, "netns": [h.netns for h in net.hosts]}), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # no cleanup
"""


def _bridges() -> set[str]:
    return {b["ifname"] for b in json.loads(_ip("-j", "link", "show", "type", "bridge").stdout or "[]")}


def test_a_network_whose_owner_was_killed_is_removed_by_the_next_one():
    out = subprocess.run([sys.executable, "-c", LEAKER], capture_output=True, text=True, timeout=60)
    leaked = json.loads(out.stdout.splitlines()[0])
    assert leaked["bridge"] in _bridges()  # the killed owner left it
    assert set(leaked["netns"]) <= set(_ip("netns", "list").stdout.split())
    with Network(1) as net:
        assert leaked["bridge"] not in _bridges() and net.bridge in _bridges()
        assert not set(leaked["netns"]) & set(_ip("netns", "list").stdout.split())
    assert remove_leaked_networks() == []  # a network removed on exit leaves nothing to sweep


def test_a_subnet_in_use_here_is_skipped():
    with Network(1) as first:
        assert _free_subnet(first.subnet) != first.subnet
        second = Network(1)
        second.subnet = first.subnet  # as if its tag had drawn the same subnet
        with second:
            assert second.subnet != first.subnet and second.gateway != first.gateway
