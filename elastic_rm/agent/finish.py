"""The end of a run when nodes finish apart: every wait on the way out is bounded by the run itself.

torch's agent, once its workers succeeded, waits in an exit barrier (``exit_barrier_timeout``, 300 s)
until every node of the round has finished. A node whose workers failed after the others had finished
(their collective lost its peers, who had already left) never arrives there: it waits the membership
grace for a new round, fails, and closes the run as its agent exits. So:

- :func:`others_finished`: the failing node stops waiting for a new round once every other node of its
  round is in the exit barrier (their workers finished: the job ends, its membership does not change);
- :func:`exit_barrier`: torch's barrier over the round's store, which ends when a member of the round
  closes the run (``RunClosedError``) instead of 300 s later.
"""

from __future__ import annotations

import logging
import time

from torch.distributed import Store
from torch.distributed.elastic.agent.server.api import _TERMINAL_STATE_SYNC_ID
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.utils import store as store_util

from ..obs.events import EventLog
from ..rendezvous.etcd_store import EtcdStore, RunClosedError

log = logging.getLogger(__name__)

# torch's barrier counts the agents that arrived under this key (torch.distributed.elastic.utils.store)
ARRIVED_KEY = _TERMINAL_STATE_SYNC_ID + "/num_members"


def others_finished(store: object, world: int | None) -> bool:
    """Whether every other node of this node's round (``world`` nodes) has reached the exit barrier in
    ``store`` (False without an elastic-rm store, or while etcd does not answer)."""
    if not isinstance(store, EtcdStore) or world is None or world <= 1:
        return False
    try:
        arrived = store.peek(ARRIVED_KEY)
    except Exception:  # noqa: BLE001 - etcd unreachable: keep waiting for the grace
        return False
    return arrived is not None and int(arrived) >= world - 1


def exit_barrier(store: Store, world: int | None, timeout_s: float, events: EventLog) -> None:
    """torch's ``SimpleElasticAgent._exit_barrier`` over ``store`` for ``world`` nodes, ended early (with a
    warning, not a traceback) when a member of the round closes the run while this node waits."""
    t0 = time.monotonic()
    try:
        store_util.barrier(
            store=store,
            world_size=world,
            key_prefix=_TERMINAL_STATE_SYNC_ID,
            barrier_timeout=timeout_s,
        )
        log.info("done waiting for the other nodes after %.1fs", time.monotonic() - t0)
    except RunClosedError as exc:
        waited = time.monotonic() - t0
        message = f"exit barrier left after {waited:.1f}s: {exc}"
        log.warning("%s", message)
        events.emit("job", message, waited_s=round(waited, 3))
    except SignalException:
        raise
    except Exception:  # noqa: BLE001 - as torch: a barrier that fails does not fail a finished node
        log.exception("error waiting on the exit barrier after %.1fs", time.monotonic() - t0)
