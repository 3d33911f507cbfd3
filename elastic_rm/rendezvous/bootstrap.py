"""Where the workers of a round bootstrap their process group (MASTER_ADDR / MASTER_PORT).

Rank 0's agent picks a free port on its address when it acks a round; the address travels in its ack
and the sealed round record, so every node hands its workers the same pair. Global rank 0's worker
hosts the TCPStore there, as torch does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per
round, which is what avoids torch 2.13's scale-up deadlock.
"""

from __future__ import annotations

import socket

from torch.distributed.elastic.utils.distributed import get_free_port


def pick_master_port() -> int:
    return int(get_free_port())


def default_local_addr() -> str:
    """What torch uses when --local-addr is not given."""
    return socket.getfqdn()
