"""An etcd endpoint given as an IPv6 address (``[::1]:2379``, as etcdctl takes it) works: the client's gRPC
target keeps the brackets. A real etcd listening on IPv6 loopback only."""

from __future__ import annotations

import socket
import subprocess
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.errors import EtcdError
from elastic_rm.etcd.server import find_etcd_binary


def _free_v6_port() -> int:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def v6_etcd(tmp_path):
    try:
        client_port, peer_port = _free_v6_port(), _free_v6_port()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    peer = f"http://[::1]:{peer_port}"
    argv = [
        find_etcd_binary(),
        "--data-dir", str(tmp_path / "data"),
        "--listen-client-urls", f"http://[::1]:{client_port}",
        "--advertise-client-urls", f"http://[::1]:{client_port}",
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"default={peer}",
    ]  # fmt: skip
    with open(tmp_path / "etcd.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"[::1]:{client_port}"
    finally:
        proc.terminate()  # by its pid
        proc.wait(30)


def test_a_client_on_an_ipv6_endpoint_reads_and_writes(v6_etcd):
    deadline = time.monotonic() + 20
    while True:
        try:
            with EtcdClient(v6_etcd, timeout=2) as c:
                c.put("/v6", b"ok")
                assert c.get("/v6").value == b"ok"
                assert c.endpoint == v6_etcd  # said as given, brackets and all
            return
        except EtcdError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
