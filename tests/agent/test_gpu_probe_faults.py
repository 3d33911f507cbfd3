"""The NVML path through the probe's interface (tests/agent/test_agent_gpu.py's fake pynvml): values a
driver or a wrapper can give that hung the monitor or hid every GPU."""

from __future__ import annotations

import threading

from elastic_rm.agent.gpu import NvmlProbe, decode_throttle_reasons

from .test_agent_gpu import FakeNvml


def _sample_within(probe: NvmlProbe, timeout_s: float):
    out: list = []
    t = threading.Thread(target=lambda: out.append(probe.sample()), daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), "NvmlProbe.sample() hung"
    return out[0]


def test_a_negative_throttle_mask_does_not_hang_the_sample():
    """A negative int has endless set bits: decoding it looped forever on the monitor's thread."""
    nvml = FakeNvml([{"util": 50, "mem": (1, 2), "temp": 40, "reasons": -1}])
    (gpu,) = _sample_within(NvmlProbe(nvml), 5.0)
    assert gpu.throttled and "hw_slowdown" in gpu.throttle_reasons
    assert len(decode_throttle_reasons(-1)) == 64  # NVML's mask is 64 bits


def test_a_gpu_lost_before_the_agent_started_hides_only_itself():
    """One failing nvmlDeviceGetHandleByIndex dropped every GPU: the node registered 0 GPUs (the planner
    then sized it by its cores) and published none."""

    class OneLost(FakeNvml):
        def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:  # noqa: N802
            if i == 1:
                raise FakeNvml.NVMLError("GPU is lost")
            return self.devices[i]

    dev = {"util": 50, "mem": (1, 2), "temp": 40, "reasons": 0}
    probe = NvmlProbe(OneLost([dev, dev, dev]))
    assert probe.device_count == 2
    assert [g.index for g in _sample_within(probe, 5.0)] == [0, 2]
