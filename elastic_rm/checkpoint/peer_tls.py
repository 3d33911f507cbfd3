"""TLS for the checkpoint transport between nodes, from the certificates the job's etcd already uses.

Why these certificates: a job that talks to etcd over TLS with client certificates already gives every
node a key, a certificate and the CA that signed them; the checkpoint servers serve HTTPS with that same
pair and require the same of their clients (mutual TLS). A peer is trusted when its certificate chains to
the job's CA; host names are not checked, because etcd client certificates seldom name the node's
address. The bearer token still guards every request. Stdlib only: workers import it.
"""

from __future__ import annotations

import json
import os
import ssl
from dataclasses import dataclass

TLS_ENV = "ELASTIC_RM_CKPT_TLS"  # JSON {"v": 1, "ca", "cert", "key", "required"}: files, set by the agent
MODES = ("auto", "required", "off")


@dataclass(frozen=True)
class PeerTls:
    """The files of one node: the CA that signs every node's certificate, and this node's pair."""

    ca: str
    cert: str
    key: str

    def server_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        # TLS 1.2: the server checks the client's certificate inside the handshake, so a refused peer gets
        # the alert as a handshake error. Under TLS 1.3 the refusal comes after the client's handshake has
        # finished, and the client saw a reset or a bad descriptor on its first read instead (measured).
        ctx.maximum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED  # a client without a certificate of the job's CA is refused
        return ctx

    def client_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # trust is the job's CA, not a host name (see the module docstring)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx


def peer_tls(mode: str, ca: str | None, cert: str | None, key: str | None) -> PeerTls | None:
    """The checkpoint transport's TLS for ``mode`` (auto: when the etcd CA and client pair are all given;
    required: an error unless they are; off: never)."""
    if mode not in MODES:
        raise ValueError(f"ckpt_tls={mode!r}: use one of {', '.join(MODES)}")
    if mode == "off":
        return None
    if ca and cert and key:
        return PeerTls(ca, cert, key)
    if mode == "required":
        raise ValueError(
            "ckpt_tls=required needs the etcd CA and a client certificate and key (--etcd-cacert, "
            "--etcd-cert, --etcd-key; rdzv-conf ca_cert, ssl_cert, ssl_cert_key): the checkpoint servers "
            "use them for HTTPS"
        )
    return None


def encode_tls(tls: PeerTls | None, required: bool) -> str:
    body = {"v": 1, "required": required}
    if tls is not None:
        body.update(ca=tls.ca, cert=tls.cert, key=tls.key)
    return json.dumps(body)


def tls_from_env() -> tuple[PeerTls | None, bool]:
    """(the TLS files, whether TLS is required) the agent gave this worker; (None, False) without."""
    text = os.environ.get(TLS_ENV)
    if not text:
        return None, False
    try:
        doc = json.loads(text)
        required = bool(doc.get("required", False))
        files = [doc.get(k) for k in ("ca", "cert", "key")]
    except (ValueError, AttributeError):
        raise ValueError(f'{TLS_ENV}: expected {{"v": 1, "ca", "cert", "key", "required"}}') from None
    if all(isinstance(f, str) and f for f in files):
        return PeerTls(*files), required
    return None, required
