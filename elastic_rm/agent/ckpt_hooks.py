"""What the agent does with checkpoint servers: start its own, publish it, and tell its workers the peers'.

Why apart from the server: these hooks talk to the rendezvous handler (which publishes the server's port
and token in the node's record and lists the other nodes' servers); the server itself knows nothing of
etcd. With torch's own rendezvous backends the hooks do nothing: restores then use local memory and the
durable copy only.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ..train.paths import run_memory_dir
from ..train.peers import PEERS_ENV, PeerEndpoint, encode_peers
from .ckpt_server import CheckpointServer

log = logging.getLogger(__name__)


def start_for_agent(handler: Any, run_id: str) -> CheckpointServer | None:
    """Start this node's server on the node's address and hand port and token to the rendezvous
    handler, which publishes them in the node's record. None when the handler cannot publish them
    (torch's backends) or the address cannot be bound (a warning: restores then use local memory and
    the durable copy only)."""
    publish = getattr(handler, "set_checkpoint_endpoint", None)
    addr = getattr(handler, "addr", None)
    if publish is None or not addr:
        return None
    root = run_memory_dir(run_id)
    server = CheckpointServer(lambda: root / handler.node_id, host=addr)
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
    publish(server.port, server.token)
    return server


def peer_endpoints(handler: Any) -> list[PeerEndpoint] | None:
    """Every other alive node that serves its checkpoints (one etcd read). None when the handler does
    not know (torch's backends)."""
    records = getattr(handler, "checkpoint_peers", None)
    if records is None:
        return None
    peers = []
    for node, (addr, port, token) in sorted(records().items()):
        host = f"[{addr}]" if ":" in addr else addr
        peers.append(PeerEndpoint(node, f"http://{host}:{port}", token))
    return peers


def peers_env(handler: Any) -> str | None:
    """ELASTIC_RM_CKPT_PEERS for this round's workers."""
    peers = peer_endpoints(handler)
    return None if peers is None else encode_peers(peers)


def set_worker_env(handler: Any) -> None:
    """Called at every worker start (a new round, new peers)."""
    try:
        value = peers_env(handler)
    except Exception as e:  # noqa: BLE001 - etcd trouble must not stop the workers; restores use local + durable
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
