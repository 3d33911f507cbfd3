"""``--metrics-host`` takes an IPv6 address (``::1``, ``::`` for every interface, ``[::1]`` as in a URL):
the endpoint's socket was always AF_INET, so an IPv6 host failed with "Address family for hostname not
supported"."""

from __future__ import annotations

import json
import socket
import urllib.request

import pytest

from elastic_rm.agent.http import AgentHttpServer
from elastic_rm.obs.metrics import AgentMetrics


def _free_v6_port() -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("host", ["::1", "[::1]", "::"])
def test_the_endpoint_serves_on_an_ipv6_host(host):
    try:
        port = _free_v6_port()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with AgentHttpServer(AgentMetrics("n0"), port, host) as server:
        assert server.url is not None and server.url.startswith("http://[")
        with urllib.request.urlopen(f"http://[::1]:{port}/healthz", timeout=5) as answer:
            assert answer.status == 200 and json.loads(answer.read())["node"] == "n0"
    assert server.url is None


def test_an_empty_host_still_serves_every_ipv4_interface():
    with AgentHttpServer(AgentMetrics("n0"), _free_v4_port(), "") as server:
        assert server.address is not None and server.address[0] == "0.0.0.0"


def _free_v4_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
