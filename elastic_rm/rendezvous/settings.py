"""Rendezvous settings from torch's ``RendezvousParameters`` (``--rdzv-conf k=v,...``), validated."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from torch.distributed.elastic.rendezvous import RendezvousParameters

from ..checkpoint.peer_tls import PeerTls, peer_tls
from ..etcd.client import EtcdClient, TlsOptions, parse_endpoints
from ..planner.job import reject_unknown
from ..wire.keyspace import DEFAULT_PREFIX, Keyspace, validate_name

log = logging.getLogger(__name__)

# The lease TTL bounds recovery from a lost node (its key must expire first) and must outlast the worst
# stall of a live agent's keep-alive thread (refreshes every TTL/3): twice the stall the lease benchmark
# finds on a loaded machine (docs/benchmarks.md, lease).
DEFAULT_LEASE_TTL = 2
# A job of this many nodes (--nnodes MAX) or more gets LARGE_RUN_LEASE_TTL by default: while all of its
# nodes act at once (the first join, the round after a loss) etcd answers refreshes late, and the gap
# between two refreshes of a live lease grows past the default TTL (docs/benchmarks.md, scale).
LARGE_RUN_NODES = 512
LARGE_RUN_LEASE_TTL = 5


def default_lease_ttl(max_nodes: int) -> int:
    """The lease TTL when ``--rdzv-conf lease_ttl`` is not given: longer for a large job, whose refreshes
    etcd answers late while all of its nodes act at once (a dead agent is still found sooner by its
    refused checkpoint port: rendezvous/dead_peers.py)."""
    return LARGE_RUN_LEASE_TTL if max_nodes >= LARGE_RUN_NODES else DEFAULT_LEASE_TTL


# --rdzv-conf keys we read, with their defaults and meaning (documented in docs/reference.md,
# "Rendezvous settings").
KNOWN_KEYS = {
    "prefix": "etcd key prefix of all runs (default /elastic-rm)",
    "lease_ttl": (
        "seconds without a heartbeat before a node counts as gone (default 2; 5 for --nnodes MAX >= 512)"
    ),
    "join_timeout": "seconds next_rendezvous waits for a round (default: 'timeout', else 600)",
    "timeout": "torchrun's legacy name for join_timeout",
    "last_call_timeout": "seconds to wait for more nodes once MIN are there (default 1)",
    "etcd_timeout": "seconds for each etcd call (default 5)",
    "ca_cert": "etcd TLS CA certificate file",
    "ssl_cert": "etcd TLS client certificate file",
    "ssl_cert_key": "etcd TLS client key file",
    "user": "etcd user (password from the 'password' key or $ELASTIC_RM_ETCD_PASSWORD)",
    "password": "etcd password",
    "node_id": "this node's id (default <host>-<pid>-<random>)",
    "nproc": "workers on this node (informational; ermrun fills it in)",
    "job_file": "JSON job description for the planner (docs/planner.md); turns the planner on",
    "ckpt_tls": (
        "checkpoint transport TLS: auto (HTTPS when the etcd CA and client pair are given), required, off"
    ),
    "peer_probe": (
        "seconds a node may reach etcd but not most of its peers before it leaves the run "
        "(default: lease_ttl; 0: off)"
    ),
    "policy": (
        "who decides rounds: membership (torch's semantics) or planner (default: planner with a job_file)"
    ),
}


def _number(params: RendezvousParameters, key: str, default: float, minimum: float = 0.0) -> float:
    raw = params.get(key, None)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        hint = ""
        if any(sep in str(raw) for sep in (";", "=", " ", ":")):
            hint = (
                " (--rdzv-conf separates key=value pairs with commas, e.g. lease_ttl=3,last_call_timeout=1)"
            )
        raise ValueError(f"--rdzv-conf {key}={raw!r} is not a number{hint}") from None
    if not math.isfinite(value):  # nan passes every comparison below; inf is no number of seconds
        raise ValueError(f"--rdzv-conf {key}={raw!r} must be a finite number")
    if value <= minimum:
        raise ValueError(f"--rdzv-conf {key}={raw!r} must be greater than {minimum:g}")
    return value


@dataclass(frozen=True)
class RendezvousSettings:
    endpoints: tuple[str, ...]
    keys: Keyspace
    min_nodes: int
    max_nodes: int
    lease_ttl: int
    join_timeout: float
    last_call_timeout: float
    etcd_timeout: float
    tls: TlsOptions
    user: str | None
    password: str | None
    local_addr: str | None
    node_id: str | None
    nproc: int
    policy: str = "membership"
    job: dict | None = None
    ckpt_tls: str = "auto"
    peer_probe_s: float = DEFAULT_LEASE_TTL  # 0: no probes (peer_probe.py)

    def etcd_client(self) -> EtcdClient:
        """A client of the run's etcd as these settings name it: endpoints, timeout, TLS, user."""
        return EtcdClient(
            list(self.endpoints),
            timeout=self.etcd_timeout,
            tls=self.tls,
            user=self.user,
            password=self.password,
        )

    def checkpoint_tls(self) -> tuple[PeerTls | None, bool]:
        """(TLS files for the checkpoint servers, whether TLS is required); checked in from_parameters."""
        tls = peer_tls(self.ckpt_tls, self.tls.ca_cert, self.tls.cert, self.tls.key)
        return tls, self.ckpt_tls == "required"

    @classmethod
    def from_parameters(cls, params: RendezvousParameters) -> RendezvousSettings:
        if params.min_nodes < 1 or params.max_nodes < params.min_nodes:
            raise ValueError(
                f"--nnodes {params.min_nodes}:{params.max_nodes} is invalid: "
                "need 1 <= MIN <= MAX (e.g. --nnodes 2:4)"
            )
        if not params.endpoint:
            raise ValueError(
                "the elastic-rm rendezvous needs --rdzv-endpoint HOST:PORT of an etcd (or use ermrun)"
            )
        # torch adds "rank" (--node-rank) itself, and "is_host" is c10d's (whether this node hosts the
        # TCP store; etcd needs no host); any other key nobody reads is a typo until proven otherwise
        reject_unknown(
            {k: None for k in params.config if k not in ("rank", "is_host")},
            frozenset(KNOWN_KEYS),
            "--rdzv-conf for elastic-rm",
            noun="key",
        )
        endpoints = tuple(f"{h}:{p}" for h, p in parse_endpoints(params.endpoint))
        tls = TlsOptions(params.get("ca_cert"), params.get("ssl_cert"), params.get("ssl_cert_key"))
        tls.validate()
        user = params.get("user")
        password = params.get("password") or os.environ.get("ELASTIC_RM_ETCD_PASSWORD") if user else None
        if user and not password:
            raise ValueError(
                "etcd user given without a password: "
                "set --rdzv-conf password=... or $ELASTIC_RM_ETCD_PASSWORD"
            )
        node_id = params.get("node_id")
        if node_id:
            validate_name("node id", node_id)
        timeout_default = _number(params, "timeout", 600.0, minimum=-math.inf) or 600.0  # 0: the default
        lease_ttl = _number(params, "lease_ttl", default_lease_ttl(params.max_nodes))
        if lease_ttl != int(lease_ttl):
            raise ValueError(f"--rdzv-conf lease_ttl={lease_ttl} must be a whole number of seconds")
        job = _load_job(params.get("job_file")) if params.get("job_file") else None
        policy = str(params.get("policy") or ("planner" if job else "membership"))
        if policy not in ("membership", "planner"):
            raise ValueError(f"--rdzv-conf policy={policy!r}: use membership or planner")
        if policy == "planner" and job is None:
            raise ValueError(
                "--rdzv-conf policy=planner needs a job description: --rdzv-conf job_file=job.json"
            )
        ckpt_tls = str(params.get("ckpt_tls") or "auto")
        peer_tls(ckpt_tls, tls.ca_cert, tls.cert, tls.key)  # a bad mode or missing files fail here, early
        return cls(
            endpoints=endpoints,
            keys=Keyspace(params.get("prefix", DEFAULT_PREFIX) or DEFAULT_PREFIX, params.run_id),
            min_nodes=params.min_nodes,
            max_nodes=params.max_nodes,
            lease_ttl=int(lease_ttl),
            join_timeout=_number(params, "join_timeout", timeout_default),
            last_call_timeout=_number(params, "last_call_timeout", 1.0, minimum=-1e-9),
            etcd_timeout=_number(params, "etcd_timeout", 5.0),
            tls=tls,
            user=user,
            password=password,
            local_addr=params.local_addr,
            node_id=node_id,
            nproc=int(_number(params, "nproc", 1.0)),
            policy=policy,
            job=job,
            ckpt_tls=ckpt_tls,
            peer_probe_s=_number(params, "peer_probe", float(lease_ttl), minimum=-1e-9),
        )


def _load_job(path: str) -> dict:
    """The planner's job description (schema: docs/planner.md), validated here so a typo fails at start."""
    import json

    from ..planner.job import JobSpecError, parse_job

    try:
        with open(path) as fh:
            job = json.load(fh)
    except OSError as exc:
        raise ValueError(f"job description {path!r} cannot be read: {exc.strerror}") from None
    except (ValueError, RecursionError) as exc:  # not JSON, a number too long to convert, absurd nesting
        raise ValueError(f"job description {path!r} is not JSON: {exc}") from None
    from ..planner.config import config_from_job

    try:
        parse_job(job, where=path)
    except JobSpecError as exc:
        raise ValueError(str(exc)) from None
    config_from_job(job, where=f"{path}: planner")
    return job
