"""Puts of one key from one client apply in the order they were issued (etcd/write_order.py)."""

from __future__ import annotations

import asyncio

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.write_order import WriteOrder


def test_a_write_of_a_key_waits_for_the_earlier_one_and_other_keys_do_not_wait():
    async def scenario() -> list[str]:
        order, sent, release = WriteOrder(), [], asyncio.Event()

        async def send(name: str, hold: bool = False) -> str:
            sent.append(f"{name} sent")
            if hold:
                await release.wait()  # an answer that takes long (etcd under load)
            sent.append(f"{name} answered")
            return name

        first = asyncio.ensure_future(order.run(["node/a"], lambda: send("first", hold=True)))
        second = asyncio.ensure_future(order.run(["node/a", "event/1"], lambda: send("second")))
        other = asyncio.ensure_future(order.run(["node/b"], lambda: send("other")))
        await asyncio.wait_for(other, 5)
        assert not second.done()  # held behind the unanswered write of node/a
        release.set()
        assert await asyncio.wait_for(second, 5) == "second" and await first == "first"
        assert len(order) == 0  # nothing is kept once answered
        return sent

    sent = asyncio.run(scenario())
    assert sent == [
        "first sent",
        "other sent",
        "other answered",
        "first answered",
        "second sent",
        "second answered",
    ]


def test_a_failed_write_does_not_hold_back_the_next_one():
    async def scenario() -> str:
        order = WriteOrder()

        async def fail() -> None:
            raise ConnectionError("etcd went away")

        async def ok() -> str:
            return "sent"

        failed = asyncio.ensure_future(order.run(["k"], fail))
        after = asyncio.ensure_future(order.run(["k"], ok))
        done = await asyncio.wait_for(after, 5)
        assert isinstance(failed.exception(), ConnectionError)
        return done

    assert asyncio.run(scenario()) == "sent"


def test_a_record_written_without_waiting_then_waited_for_ends_as_the_last_write(etcd):
    """What the join and a restart right after it do with a node's record: the last write wins."""
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        for i in range(50):
            c.puts_nowait([("node", f"active {i}", None), (f"event/{i}", "x" * 4096, None)])
            c.put_nowait("node", f"republished {i}")
            c.put("node", f"joining {i}")
            got = c.get("node")
            assert got is not None and got.value == f"joining {i}".encode()


def test_a_delete_after_a_put_sent_without_waiting_leaves_the_key_deleted(etcd):
    """A release deletes its record right after a republish sent without waiting: the key stays gone."""
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        for i in range(50):
            c.put_nowait("node", f"republished {i}")
            c.delete("node")
            assert c.get("node") is None, i
