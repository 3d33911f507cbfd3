"""Writes of one key from one client reach etcd in the order they were issued.

Two requests in flight at once are not ordered: etcd serves each gRPC stream on its own goroutine, and
under load the later one can be applied first. A node's record is written both ways: without waiting
(registered as active when it joins a round, with its "round" event) and waited for (registered as
joining when its workers fail right after). Applied out of order, the record says "active" again, and the
leader never sees the node come back: the round of its restart does not come.

So every put or single-key delete of a key waits, on the client's loop, until the writes of that key
issued before it are answered (a release's delete must not be overtaken by a record sent without waiting);
a write of other keys does not wait. Transactions and prefix deletes are not ordered this way. Runs on the
loop thread only (no lock).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any


class WriteOrder:
    """The newest unanswered write of each key, which the next write of that key waits for."""

    def __init__(self) -> None:
        self._tails: dict[str, asyncio.Future] = {}

    def __len__(self) -> int:
        return len(self._tails)

    async def run(self, keys: Iterable[str], send: Callable[[], Awaitable[Any]]) -> Any:
        """``send()`` once the earlier writes of ``keys`` are answered (or failed: they are not retried,
        so a failure must not hold the next write back). Must be the coroutine's first await: tasks
        start in the order they were submitted, and this one claims its keys before it yields."""
        task = asyncio.current_task()
        assert task is not None, "WriteOrder.run must run in a task"
        keys = list(dict.fromkeys(keys))
        before = {t for k in keys if (t := self._tails.get(k)) is not None}
        for k in keys:
            self._tails[k] = task
        try:
            if before:
                await asyncio.wait(before)
            return await send()
        finally:
            for k in keys:
                if self._tails.get(k) is task:
                    del self._tails[k]
