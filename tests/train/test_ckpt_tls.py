"""The checkpoint transport over TLS: agents whose etcd uses client certificates serve HTTPS with them,
peers verify each other against the job's CA, and a peer with a certificate of another CA is refused."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rm.agent.ckpt_hooks import peers_env, start_for_agent
from elastic_rm.checkpoint.manifest import step_dirname
from elastic_rm.checkpoint.node_memory import run_memory_dir
from elastic_rm.checkpoint.peer_tls import TLS_ENV, PeerTls
from elastic_rm.checkpoint.peers import PeerClient, PeerEndpoint, PeerError, parse_peers
from elastic_rm.checkpoint.server import CheckpointServer
from elastic_rm.checkpoint.sources import FileResolver, HttpPeerSource
from elastic_rm.rendezvous.registration import create_handler
from elastic_rm.rendezvous.settings import RendezvousSettings
from tests.etcd.test_tls import openssl, pki, tls_etcd  # noqa: F401 - fixtures
from tests.train.test_ckpt_transport import make_step


@pytest.fixture(scope="module")
def rogue(tmp_path_factory) -> PeerTls:
    """A certificate and key signed by a CA that is not the job's."""
    d = tmp_path_factory.mktemp("rogue")
    curve = "-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes"
    openssl(*f"req -x509 {curve} -days 2 -subj /CN=rogue-ca -keyout ca.key -out ca.pem".split(), cwd=d)
    openssl(*f"req {curve} -subj /CN=rogue -keyout r.key -out r.csr".split(), cwd=d)
    x509 = "x509 -req -in r.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 -out r.pem"
    openssl(*x509.split(), cwd=d)
    return PeerTls(str(d / "ca.pem"), str(d / "r.pem"), str(d / "r.key"))


def job_tls(pki) -> PeerTls:  # noqa: F811
    return PeerTls(str(pki / "ca.pem"), str(pki / "client.pem"), str(pki / "client.key"))


def test_agents_serve_https_and_a_worker_restores_from_a_peer(pki, tls_etcd, run_id, monkeypatch) -> None:  # noqa: F811
    """Two agents over an etcd that requires client certificates: each checkpoint server speaks HTTPS
    with the node's etcd pair, the peer list says https, and a restore fetches and verifies a peer's file."""
    monkeypatch.setenv(TLS_ENV, "")  # start_for_agent sets it for this process's clients; undone after
    conf = {
        "lease_ttl": "2",
        "last_call_timeout": "0.3",
        "join_timeout": "60",
        "ckpt_tls": "required",
        "ca_cert": str(pki / "ca.pem"),
        "ssl_cert": str(pki / "client.pem"),
        "ssl_cert_key": str(pki / "client.key"),
    }
    params = RendezvousParameters(
        "elastic-rm", tls_etcd.endpoint, run_id, 2, 2, local_addr="127.0.0.1", **conf
    )
    handlers = [create_handler(params) for _ in range(2)]
    servers = []
    try:
        servers = [start_for_agent(h.services, run_id) for h in handlers]
        assert all(s is not None and s.url.startswith("https://127.0.0.1:") for s in servers)
        assert json.loads(os.environ[TLS_ENV])["required"] is True
        payload = os.urandom(1 << 16)
        body = make_step(run_memory_dir(run_id) / handlers[1].node_id, 5, {"__0_0.distcp": payload})
        threads = [threading.Thread(target=h.next_rendezvous) for h in handlers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        peers = parse_peers(peers_env(handlers[0].services) or "")
        assert [(p.node, p.url) for p in peers] == [(handlers[1].node_id, servers[1].url)]
        source = HttpPeerSource(peers[0], run_memory_dir(run_id) / "cache", timeout_s=20)
        assert source.steps() == [5] and source.manifest_bytes(5) == body
        path = FileResolver(5, json.loads(body), [source]).path("__0_0.distcp")
        assert path.read_bytes() == payload and source.bytes_fetched == len(payload)
        # a plain-HTTP client is refused by the server (it speaks TLS only)
        plain = PeerClient(PeerEndpoint("x", servers[1].url.replace("https", "http"), servers[1].token))
        plain._required = False
        with pytest.raises(PeerError, match=servers[1].url.replace("https", "http")):
            plain.steps()
    finally:
        for s in servers:
            if s is not None:
                s.stop()
        for h in handlers:
            h.shutdown()
        shutil.rmtree(run_memory_dir(run_id), ignore_errors=True)


def test_a_peer_with_a_certificate_of_another_ca_is_refused(pki, rogue, tmp_path: Path, caplog) -> None:  # noqa: F811
    make_step(tmp_path / "n0", 3, {"__0_0.distcp": b"x" * 100})
    good = job_tls(pki)
    with CheckpointServer(tmp_path / "n0", tls=good) as server:
        peer = PeerEndpoint("n0", server.url, server.token)
        assert PeerClient(peer, 20, tls=good).steps() == [3]
        with pytest.raises(PeerError, match=r"n0 \(https://.*TLS handshake failed.*job's CA"):
            PeerClient(peer, 20, tls=rogue).steps()  # the server refuses the client's certificate
        for _ in range(200):  # the server logs from its request thread, maybe after the client returned
            if "refused 127.0.0.1: TLS handshake failed" in caplog.text:
                break
            time.sleep(0.05)
        assert "refused 127.0.0.1: TLS handshake failed (TLSV1_ALERT_UNKNOWN_CA)" in caplog.text
    with CheckpointServer(tmp_path / "n0", tls=rogue) as impostor:
        peer = PeerEndpoint("n0", impostor.url, impostor.token)
        with pytest.raises(PeerError, match=r"TLS handshake failed \(CERTIFICATE_VERIFY_FAILED\)"):
            PeerClient(peer, 20, tls=good).steps()  # the client refuses the server's certificate
        dest = tmp_path / "got" / "f"
        with pytest.raises(PeerError, match="TLS handshake failed"):
            PeerClient(peer, 20, tls=good).download(3, "__0_0.distcp", dest)
        assert not dest.exists()
    with CheckpointServer(tmp_path / "n0") as plain:  # TLS on this side: a plain-HTTP peer is not used
        with pytest.raises(PeerError, match="refusing plain HTTP"):
            PeerClient(PeerEndpoint("n0", plain.url, plain.token), 20, tls=good).steps()
    assert (tmp_path / "n0" / step_dirname(3)).is_dir()


def test_ckpt_tls_setting_is_checked_when_the_rendezvous_is_configured(pki) -> None:  # noqa: F811
    def settings(**conf: str) -> RendezvousSettings:
        return RendezvousSettings.from_parameters(
            RendezvousParameters("elastic-rm", "127.0.0.1:2379", "r", 1, 1, **conf)
        )

    with pytest.raises(ValueError, match="ckpt_tls=required needs the etcd CA and a client certificate"):
        settings(ckpt_tls="required")
    with pytest.raises(ValueError, match="ckpt_tls='maybe': use one of auto, required, off"):
        settings(ckpt_tls="maybe")
    files = {
        "ca_cert": str(pki / "ca.pem"),
        "ssl_cert": str(pki / "client.pem"),
        "ssl_cert_key": str(pki / "client.key"),
    }
    assert settings(**files).checkpoint_tls() == (job_tls(pki), False)
    assert settings(**files, ckpt_tls="off").checkpoint_tls() == (None, False)
    assert settings(ca_cert=str(pki / "ca.pem")).checkpoint_tls() == (None, False)  # no client pair: plain
