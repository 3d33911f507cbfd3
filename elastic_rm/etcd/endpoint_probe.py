"""Which etcd endpoint a client fails over to: every other one is asked at once; one with a leader wins.

Why not simply the next one in the list: a member cut off from the others (a partition) still accepts
connections, but without a leader its reads and writes wait until they time out; trying the endpoints
one after another then spends a call's timeout on each bad one while the process's leases run down (the
raft leader's partition in tests/netns cost healthy nodes their leases in one of six runs: agents
connected to a healthy follower timed out during the election and rotated on to the cut-off member).
A dead member costs a try too. A Status call needs no quorum: every member that is up answers it at
once, and its ``leader`` is 0 on a member that has none.
"""

from __future__ import annotations

import asyncio

import aetcd
from aetcd import rpc

PROBE_TIMEOUT_S = 1.0  # at most this long for the other endpoints to answer, at every failover


async def has_leader(client: aetcd.Client, timeout: float) -> bool:
    """True when the member behind ``client`` answers Status and knows a leader (no quorum needed)."""
    await client.connect()
    reply = await client.maintenancestub.Status(
        rpc.StatusRequest(), timeout=timeout, metadata=client.metadata
    )
    return reply.leader != 0 and not list(reply.errors)


async def best_endpoint(candidates: dict[int, aetcd.Client], timeout: float) -> int | None:
    """The key of the candidate to fail over to: the first whose member answered with a leader within
    ``timeout``, else the first that answered at all (reachable: during an election no member has a
    leader yet, and the one cut off by a partition does not answer), else None. All are asked at once;
    the ones still asking at the end are cancelled."""
    pending = {asyncio.ensure_future(has_leader(c, timeout)): key for key, c in candidates.items()}
    answered: list[int] = []  # reachable, no leader yet, in the order they answered
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        while pending:
            left = deadline - loop.time()
            if left <= 0:
                break
            done, _ = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                key = pending.pop(task)
                if task.cancelled() or task.exception() is not None:
                    continue
                if task.result():
                    return key
                answered.append(key)
        return answered[0] if answered else None
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in candidates.values()), return_exceptions=True)
