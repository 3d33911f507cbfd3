"""Agent options and monitor settings that argparse's float() accepts: nan, inf (``ermrun --drain-grace nan``,
``--sample-interval inf``)."""

from __future__ import annotations

import math
import threading
import time

import pytest

from elastic_rm.agent.agent import AgentOptions
from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.monitor import ResourceMonitor


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("sample_interval_s", math.inf, "--sample-interval"),
        ("sample_interval_s", math.nan, "--sample-interval"),
        ("drain_grace_s", math.nan, "--drain-grace"),
        ("membership_grace_s", math.nan, "--membership-grace"),
    ],
)
def test_a_nan_or_infinite_setting_is_refused_at_start(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        AgentOptions(**{field: value}).validate()


def test_a_nan_drain_grace_would_raise_in_the_drain():
    """Why it must fail at start: it passed validate() and raised in the drain, at the job's end."""
    with AgentChannel() as ch, pytest.raises(ValueError, match="drain grace"):
        ch.wait_for_acks(timeout_s=math.nan, pids=[])


@pytest.mark.parametrize("interval", [math.inf, 1e300])
def test_the_monitor_refuses_an_interval_its_thread_cannot_wait(interval):
    """Event.wait(inf) raised OverflowError: the sampling thread died after its first sample, and with
    one sample there is no CPU utilisation, so the node never published metrics."""
    with pytest.raises(ValueError, match="finite"):
        ResourceMonitor(interval_s=interval, gpu_probe=None, scope=None)
    with pytest.raises(ValueError, match="finite"):
        ResourceMonitor(window_s=math.inf, gpu_probe=None, scope=None)


def test_a_large_finite_interval_keeps_the_thread_alive():
    mon = ResourceMonitor(interval_s=1e6, gpu_probe=None, scope=None).start()
    try:
        time.sleep(0.3)
        assert any(t.name == "elastic-rm-monitor" and t.is_alive() for t in threading.enumerate())
    finally:
        mon.stop()
