"""The client and the rendezvous against a real etcd that requires TLS with client certificates."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters

from elastic_rm.etcd.client import EtcdClient, TlsOptions
from elastic_rm.etcd.errors import EtcdConnectionError
from elastic_rm.etcd.server import EtcdCluster, ServerTls
from elastic_rm.rendezvous.registration import create_handler
from tests.etcd.test_fork import _run


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=erm-test-ca",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        cwd=d,
    )
    (d / "san.ext").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    for name in ("server", "client"):
        openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            f"/CN={name}",
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            cwd=d,
        )
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-days",
            "2",
            "-extfile",
            "san.ext",
            "-out",
            f"{name}.pem",
            cwd=d,
        )
    return d


@pytest.fixture(scope="module")
def tls_etcd(pki):
    tls = ServerTls(
        cert=str(pki / "server.pem"),
        key=str(pki / "server.key"),
        ca=str(pki / "ca.pem"),
        client_cert=str(pki / "client.pem"),
        client_key=str(pki / "client.key"),
    )
    with EtcdCluster(size=1, tls=tls) as cluster:
        yield cluster


def test_client_with_certificates_reads_and_writes(pki, tls_etcd):
    tls = TlsOptions(ca_cert=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    with EtcdClient(tls_etcd.endpoint, timeout=3, tls=tls) as c:
        c.put("/tls/k", "v")
        assert c.get("/tls/k").value == b"v"


def test_client_without_a_certificate_is_refused(pki, tls_etcd):
    with pytest.raises(EtcdConnectionError, match=tls_etcd.endpoint):
        EtcdClient(tls_etcd.endpoint, timeout=2).ping()  # plaintext against a TLS port


def test_rendezvous_over_tls(pki, tls_etcd, run_id):
    conf = {
        "ca_cert": str(pki / "ca.pem"),
        "ssl_cert": str(pki / "client.pem"),
        "ssl_cert_key": str(pki / "client.key"),
    }
    handlers = [
        create_handler(
            RendezvousParameters(
                "elastic-rm", tls_etcd.endpoint, run_id, 2, 2, local_addr="127.0.0.1", **conf
            )
        )
        for _ in range(2)
    ]
    try:
        infos = {}
        threads = [
            threading.Thread(target=lambda i=i: infos.setdefault(i, handlers[i].next_rendezvous()))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(i.rank for i in infos.values()) == [0, 1]
    finally:
        for h in handlers:
            h.release()
    with pytest.raises(RendezvousConnectionError):
        create_handler(RendezvousParameters("elastic-rm", tls_etcd.endpoint, run_id, 1, 1, etcd_timeout="2"))


def test_erm_commands_read_a_run_over_tls_with_client_certificates(
    pki, tls_etcd, run_id, tmp_path, monkeypatch
):
    """erm status / events / report / top take ermrun's --etcd-cacert/--etcd-cert/--etcd-key; without
    them an etcd that requires client certificates is a clear error (top: only that error is run here, it
    is interactive otherwise)."""
    from elastic_rm.obs.events import EventLog
    from elastic_rm.wire.keyspace import Keyspace
    from elastic_rm.wire.records import NodeRecord, RoundRecord, dumps
    from tests.e2e.test_erm_status import erm

    keys = Keyspace("/elastic-rm", run_id)
    tls = TlsOptions(ca_cert=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    with EtcdClient(tls_etcd.endpoint, timeout=3, tls=tls) as c:
        c.put(keys.node("n0"), dumps(NodeRecord("n0", "h", "127.0.0.1", 1, 1, "active")))
        c.put(keys.round, dumps(RoundRecord(round=1, members=("n0",), leader="n0", sealed=True)))
        log = EventLog(run_id, "n0", client=c, keys=keys)
        log.emit("round", "round 1: n0", round=1, members=["n0"], world=1)
        assert log.flush()
    conn = ["--endpoint", tls_etcd.endpoint, "--timeout", "2"]
    certs = [
        "--etcd-cacert",
        str(pki / "ca.pem"),
        "--etcd-cert",
        str(pki / "client.pem"),
        "--etcd-key",
        str(pki / "client.key"),
    ]

    ok = erm("status", *conn, *certs, "--run-id", run_id, "--json")
    assert ok.returncode == 0, ok.stderr
    assert '"round": 1' in ok.stdout or '"number": 1' in ok.stdout, ok.stdout[:2000]
    events = erm("events", *conn, *certs, "--run-id", run_id)
    assert events.returncode == 0 and "round 1: n0" in events.stdout, events.stderr
    report = erm("report", run_id, *conn, *certs, "-o", str(tmp_path))
    assert report.returncode == 0, report.stderr
    assert (tmp_path / f"{run_id}.html").is_file()

    commands = (["status", "--run-id", run_id], ["events", "--run-id", run_id], ["report", run_id])
    for command in (*commands, ["top", "--run-id", run_id]):
        refused = erm(*command, *conn)
        assert refused.returncode == 2 and tls_etcd.endpoint in refused.stderr, refused.stderr
    half = erm("status", *conn, "--run-id", run_id, "--etcd-cert", str(pki / "client.pem"))
    assert half.returncode == 2 and "both --etcd-cert and --etcd-key" in half.stderr, half.stderr
    monkeypatch.delenv("ELASTIC_RM_ETCD_PASSWORD", raising=False)
    nopw = erm("status", *conn, *certs, "--run-id", run_id, "--etcd-user", "alice")
    assert nopw.returncode == 2 and "ELASTIC_RM_ETCD_PASSWORD" in nopw.stderr, nopw.stderr


def _tls_child_work(endpoint: str, tls: TlsOptions) -> tuple:
    with EtcdClient(endpoint, timeout=3, tls=tls) as c:
        c.put("/tls/forked", "v")
        seen: list = []
        cancel = c.watch_prefix("/tls/forked", 1, seen.extend, exact=True)
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        cancel()
        return c.transport, c.get("/tls/forked").value, len(seen)


def test_a_forked_child_uses_tls_over_the_gateway(pki, tls_etcd):
    """Forked while this process holds a TLS client: the child's gateway transport uses the same CA and
    key pair."""
    tls = TlsOptions(ca_cert=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    with EtcdClient(tls_etcd.endpoint, timeout=3, tls=tls) as parent:
        parent.put("/tls/parent", "p")
        assert _run("fork", _tls_child_work, tls_etcd.endpoint, tls) == ("ok", ("gateway", b"v", 1))
        got = _run("fork", _tls_child_work, tls_etcd.endpoint, TlsOptions(ca_cert=str(pki / "ca.pem")))
        assert got[:2] == ("error", "EtcdConnectionError") and tls_etcd.endpoint in got[2], got
