"""Wait until rank 0's TCPStore listens before a rank connects to it.

Why: ``init_process_group`` on rank 0 starts the round's TCPStore server, and every other rank connects
to it as a client. A client that tries before the server listens is refused, and torch's client then backs
off for a jittered 0.3-0.6 s (measured on this version of torch: in 2 of 6 simultaneous starts of 3 ranks,
all three waited that long). In a round in place every rank reaches its ``init_process_group`` within
milliseconds of the others, so that back-off was most of a planned round's downtime. Probing the port
(a plain TCP connect, closed at once) until it answers costs milliseconds and lets torch's client connect
at its first try.
"""

from __future__ import annotations

import os
import socket
import time

PROBE_INTERVAL_S = 0.005
WAIT_LIMIT_S = 2.0  # then torch's own client takes over (with its back-off and timeout)


def wait_for_master_store(limit_s: float = WAIT_LIMIT_S) -> bool:
    """On a rank other than 0, wait (bounded) until ``MASTER_ADDR:MASTER_PORT`` accepts a connection.

    Returns whether it did; False also where there is nothing to wait for (rank 0, no address in the
    environment, or workers that use their agent's store, which listens before the workers start)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if os.environ.get("RANK", "0") == "0" or not addr or not port:
        return False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return False
    deadline = time.monotonic() + limit_s
    while True:
        try:
            socket.create_connection((addr, int(port)), timeout=0.1).close()
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(PROBE_INTERVAL_S)
