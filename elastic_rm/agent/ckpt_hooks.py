"""What the agent does with checkpoint servers: start its own, publish it, and tell its workers the peers'.

Why apart from the server: these hooks talk to the node services (elastic_rm.rendezvous.services, which
publish the server's port and token in the node's record and list the other nodes' servers); the server
itself knows nothing of etcd. With torch's own rendezvous backends the hooks do nothing: restores then use
local memory and the durable copy only.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..checkpoint.node_memory import run_memory_dir
from ..checkpoint.peer_tls import TLS_ENV, encode_tls
from ..checkpoint.peers import PEERS_ENV, PeerEndpoint, encode_peers
from ..checkpoint.server import CheckpointServer

if TYPE_CHECKING:
    from ..rendezvous.services import NodeServices

log = logging.getLogger(__name__)


def start_for_agent(services: NodeServices | None, run_id: str) -> CheckpointServer | None:
    """Start this node's server on the node's address and hand port and token to the node services,
    which publish them in the node's record. None without node services (torch's backends) or when the
    address cannot be bound (a warning: restores then use local memory and the durable copy only)."""
    if services is None or not services.addr:
        return None
    addr = services.addr
    root = run_memory_dir(run_id)
    tls, required = services.checkpoint_tls
    os.environ[TLS_ENV] = encode_tls(tls, required)  # this agent's peer clients and its workers read it
    server = CheckpointServer(lambda: root / services.node_id, host=addr, tls=tls)
    try:
        server.start()
    except OSError as e:
        log.warning(
            "checkpoint server: cannot listen on %s (%s); peers cannot fetch or replicate this node's flash "
            "checkpoints (set --local-addr to an address of this machine)",
            addr,
            e,
        )
        return None
    services.set_checkpoint_endpoint(server.port, server.token)
    return server


def peer_endpoints(services: NodeServices | None) -> list[PeerEndpoint] | None:
    """Every other alive node that serves its checkpoints (one etcd read). None without node services
    (torch's backends)."""
    if services is None:
        return None
    tls, _required = services.checkpoint_tls
    scheme = "https" if tls is not None else "http"  # every node of a run shares its etcd settings
    peers = []
    for node, (addr, port, token) in sorted(services.checkpoint_peers().items()):
        host = f"[{addr}]" if ":" in addr else addr
        peers.append(PeerEndpoint(node, f"{scheme}://{host}:{port}", token))
    return peers


def peers_env(services: NodeServices | None) -> str | None:
    """ELASTIC_RM_CKPT_PEERS for this round's workers."""
    peers = peer_endpoints(services)
    return None if peers is None else encode_peers(peers)


def set_worker_env(services: NodeServices | None) -> None:
    """Called at every worker start (a new round, new peers)."""
    try:
        value = peers_env(services)
    except Exception as e:  # noqa: BLE001 - etcd trouble must not stop the workers
        log.warning(
            "checkpoint peers unknown for this round (%s): workers restore from local memory and the "
            "durable copy only",
            e,
        )
        value = None
    if value is None:
        os.environ.pop(PEERS_ENV, None)
    else:
        os.environ[PEERS_ENV] = value
