"""The rejoin gate: a node that stepped out of the run registers again only once it reaches its peers.

Why: a node readmitted while still cut off (elastic_rm.rendezvous.peer_probe) stalls the next round too,
over and over. So before it registers again, it waits (bounded by join_timeout) until the cut-off rule
(:func:`elastic_rm.rendezvous.peer_quorum.holds_back`) no longer holds against the run's other live nodes.
"""

from __future__ import annotations

import logging
import time

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from .peer_quorum import holds_back
from .peer_sockets import live_targets, probe_sample, unreachable_of
from .session import NodeSession

log = logging.getLogger(__name__)

GATE_LOG_EVERY_S = 10.0


def wait_to_rejoin(client: EtcdClient, session: NodeSession, interval_s: float) -> None:
    """Probe the run's other live nodes every ``interval_s`` until this node reaches more than half of
    them (at most join_timeout, then it rejoins anyway, with a warning), or the session is released."""
    timeout = session.settings.join_timeout
    t0 = time.monotonic()
    next_log = t0 + GATE_LOG_EVERY_S
    while not session.released:
        try:
            targets = probe_sample(live_targets(client, session.settings.keys.nodes, session.node_id))
            lost = unreachable_of(targets)
            if not holds_back(len(targets), len(lost)):
                waited = time.monotonic() - t0
                reached = len(targets) - len(lost)
                message = f"reaches {reached} of {len(targets)} peers again after {waited:.1f}s: rejoining"
                log.warning("node %s %s", session.node_id, message)  # the end of the step-out
                session.events.emit("node", message, waited_s=round(waited, 3))
                break
        except EtcdError as exc:
            log.debug("peer probe gate: %s", exc)
            lost = set()
        now = time.monotonic()
        if now - t0 > timeout:
            log.warning(
                "node %s still cannot reach its peers after %.0fs (join_timeout): rejoining anyway",
                session.node_id,
                now - t0,
            )
            break
        if now >= next_log:
            next_log = now + GATE_LOG_EVERY_S
            log.warning(
                "node %s waits to reach its peers before rejoining (unreachable: %s)",
                session.node_id,
                ", ".join(sorted(lost)) or "?",
            )
        time.sleep(interval_s)
