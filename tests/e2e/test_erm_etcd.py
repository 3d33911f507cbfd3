"""`erm etcd` runs a real etcd member that the rendezvous can use, and stops by its pid."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.errors import EtcdError
from elastic_rm.etcd.server import free_port
from tests.conftest import BIN, Proc


def test_erm_etcd_serves_clients(tmp_path, procs):
    client_port, peer_port = free_port(), free_port()
    argv = [
        os.path.join(BIN, "erm"),
        "etcd",
        "--name",
        "m1",
        "--data-dir",
        str(tmp_path / "data"),
        "--listen-host",
        "127.0.0.1",
        "--advertise-host",
        "127.0.0.1",
        "--client-port",
        str(client_port),
        "--peer-port",
        str(peer_port),
    ]
    p = Proc(argv, str(tmp_path / "etcd.log"))
    procs.append(p)
    deadline = time.monotonic() + 20
    while True:
        try:
            with EtcdClient(f"127.0.0.1:{client_port}", timeout=1) as c:
                c.put("/erm/probe", "ok")
                assert c.get("/erm/probe").value == b"ok"
            break
        except EtcdError:
            assert time.monotonic() < deadline, p.output()
            time.sleep(0.2)
    assert (tmp_path / "data" / "member").is_dir()  # data kept where asked
    p.signal(signal.SIGTERM)
    assert p.wait(10) is not None


def test_erm_etcd_rejects_half_tls(tmp_path):
    erm = os.path.join(BIN, "erm")
    result = subprocess.run(
        [erm, "etcd", "--cert-file", "/etc/hostname"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2 and "--cert-file and --key-file go together" in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--client-port", "99999"], "argument --client-port: '99999': a port number from 1 to 65535"),
        (["--peer-port", "0"], "argument --peer-port: '0': a port number from 1 to 65535"),
        (["--client-port", "2400", "--peer-port", "2400"], "--client-port and --peer-port are both 2400"),
    ],
)
def test_erm_etcd_refuses_ports_etcd_cannot_listen_on_before_starting_it(tmp_path, args, message):
    erm = os.path.join(BIN, "erm")
    argv = [erm, "etcd", "--data-dir", str(tmp_path / "data"), "--print-command", *args]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "data").exists()
