"""Step-time reports the channel accepted although the record built from them could not be used: a
negative sample count, and steps so short that samples / time is infinite."""

from __future__ import annotations

import struct

import pytest

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.monitor import ResourceSummary
from elastic_rm.agent.record import build_record
from elastic_rm.wire.channel import HEADER, KIND_STEPS, MAGIC, STEPS, VERSION
from elastic_rm.wire.metrics import encode_record, parse_record

RESOURCES = ResourceSummary(
    t=1.0,
    samples=2,
    cpu_util_mean=0.5,
    cpu_util_max=0.5,
    cpu_util_last=0.5,
    mem_used_bytes=1,
    mem_available_bytes=1,
    mem_total_bytes=2,
    workers=(),
    gpus=(),
)


def steps_datagram(pid: int, samples: int, durs: list[float]) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, KIND_STEPS, pid, 0, 0) + STEPS.pack(10, samples, len(durs))
    return head + struct.pack(f"<{2 * len(durs)}d", *durs, *durs)


@pytest.fixture
def channel():
    ch = AgentChannel(window_s=30.0)
    try:
        yield ch
    finally:
        ch.close()


def published(channel: AgentChannel):
    """What the leader reads of this node's record (encode_record raises where the agent cannot publish)."""
    return parse_record(encode_record(build_record("n1", RESOURCES, channel.summary())), "metrics/n1")


def test_a_negative_sample_count_is_dropped_not_published(channel):
    """It made samples_per_s negative: the leader rejected the node's every record for the window."""
    channel.handle_datagram(steps_datagram(7, 32, [0.1, 0.1]))
    channel.handle_datagram(steps_datagram(7, -64, [0.1, 0.1]))
    assert channel.malformed_total == 1
    rec = published(channel)
    assert rec.steps is not None and rec.steps.samples_per_s == pytest.approx(160.0)


def test_steps_of_next_to_no_time_leave_the_record_publishable(channel):
    """64 samples in 1e-320 s is inf samples/s: encode_record refused it and the node published nothing
    (CPU and memory included) while the report was in the window."""
    channel.handle_datagram(steps_datagram(7, 64, [1e-320, 1e-320]))
    channel.handle_datagram(steps_datagram(8, 32, [0.1, 0.1]))
    rec = published(channel)
    assert rec.steps is not None and rec.steps.samples_per_s == pytest.approx(160.0)


@pytest.mark.parametrize("pid", [0, -1])
def test_a_datagram_without_a_process_id_is_dropped_and_the_next_round_starts(channel, pid):
    """psutil refuses pid <= 0 with ValueError: a hello from "pid -1" was kept, and clear_drain (the
    agent's start of the next round's workers) raised it."""
    from elastic_rm.wire.channel import KIND_HELLO

    channel.handle_datagram(HEADER.pack(MAGIC, VERSION, KIND_HELLO, pid, 0, 0))
    channel.handle_datagram(steps_datagram(pid, 32, [0.1]))
    assert channel.malformed_total == 2 and channel.workers() == {}
    channel.request_drain()
    channel.clear_drain()
    assert not channel.drain_requested
