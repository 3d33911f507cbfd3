"""A node that finds the run closed, under stock torchrun: exit 0 with a message, not a traceback.

torch's agent turns RendezvousGracefulExitError (the run is closed) into a None result, and torch 2.13's
``launch_agent`` (what stock torchrun and ``elastic_launch`` run) then calls ``result.is_failed()`` on it
and dies with AttributeError, exit status 1. We cannot change torch, so when its launch_agent is the one
creating the handler, the handler ends the process itself, status 0, after saying why. ermrun's own launch
path handles the None result, and direct callers of the handler get torch's RendezvousGracefulExitError as
the rendezvous API specifies.
"""

from __future__ import annotations

import inspect
import logging
import sys

from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousGracefulExitError,
    RendezvousInfo,
)
from torch.distributed.launcher import api as torch_launcher

from .handler import ElasticRMRendezvousHandler

log = logging.getLogger(__name__)


class ExitsWhenClosed(ElasticRMRendezvousHandler):
    """The handler under torch's own launch_agent: a closed run ends the process with status 0."""

    def next_rendezvous(self) -> RendezvousInfo:
        try:
            return super().next_rendezvous()
        except RendezvousGracefulExitError as exc:
            log.warning(
                "elastic-rm: node %s: %s. The job finished before this node was needed (it arrived after "
                "the run closed, or waited as standby until then); exiting with status 0",
                self.node_id,
                exc,
            )
            self.release()
            raise SystemExit(0) from None
        except RendezvousClosedError as exc:  # the run failed or was stopped before this node started
            log.error("elastic-rm: node %s: %s", self.node_id, exc)
            self.release()
            raise SystemExit(1) from None


def created_by_torch_launch_agent(max_depth: int = 64) -> bool:
    """Whether torch's ``launch_agent`` is on the call stack (it creates the handler it then runs)."""
    target = inspect.unwrap(torch_launcher.launch_agent).__code__
    frame = sys._getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return False
        if frame.f_code is target:
            return True
        frame = frame.f_back
    return False
