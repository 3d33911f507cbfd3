"""Where the workers of a round bootstrap their process group (MASTER_ADDR / MASTER_PORT).

Every node advertises a free port on its address in its record (picked when it joined its previous
round, so not the port that round's store holds); rank 0's agent names it in its ack unless something
took it meanwhile (then a new one), and the pair travels in the sealed round record, so every node hands
its workers the same pair. A node joining the run reads it from rank 0's record before the seal
(elastic_rm/agent/prepared.py). Global rank 0's worker
hosts the TCPStore there, as torch does with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: a fresh store per
round, which is what avoids torch 2.13's scale-up deadlock.
"""

from __future__ import annotations

import socket

from torch.distributed.elastic.utils.distributed import get_free_port


def pick_master_port() -> int:
    return int(get_free_port())


def port_is_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` on every address now (as rank 0's TCPStore will)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def default_local_addr() -> str:
    """What torch uses when --local-addr is not given."""
    return socket.getfqdn()
