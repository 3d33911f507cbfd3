"""The per-round store that the agents (and, when shared, the workers) use, hosted by rank 0's agent.

torch's agent needs a ``torch.distributed.Store`` from the rendezvous for rank assignment and its exit
barrier, and workers need MASTER_ADDR/MASTER_PORT. We give every round a fresh TCPStore hosted by that
round's group-rank-0 agent; its address travels in rank 0's ack and the sealed round record. A fresh
store per round is what avoids torch 2.13's scale-up deadlock (reference/feasibility.md, gotcha 1):
nothing depends on who hosted the store of an earlier round.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.utils.distributed import get_free_port


class RoundStoreHost:
    """Rank 0's side: a TCPStore server for one round."""

    def __init__(self, bind_addr: str, advertise_addr: str, timeout: float, share_with_workers: bool):
        self.store = TCPStore(
            host_name=bind_addr,
            port=0,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout),
            multi_tenant=True,
            use_libuv=True,
        )
        self.addr = advertise_addr
        self.port = int(self.store.port)
        # Shared: workers use the agent's store (torch's default). Else rank 0's worker hosts its own.
        self.master_port = self.port if share_with_workers else get_free_port()


def connect_round_store(addr: str, port: int, timeout: float) -> Store:
    return TCPStore(
        host_name=addr, port=port, is_master=False, timeout=timedelta(seconds=timeout), use_libuv=True
    )


def prefixed(store: Store, run_id: str, round_number: int) -> Store:
    return PrefixStore(f"torch.rendezvous.{run_id}.{round_number}", store)


def default_local_addr() -> str:
    """What torch uses when --local-addr is not given."""
    return socket.getfqdn()
