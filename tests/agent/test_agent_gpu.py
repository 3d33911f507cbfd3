"""GPU probe: the real no-GPU path, and the NVML path through a fake pynvml (the one allowed fake)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic_rm.agent.gpu import NoGpuProbe, NvmlProbe, decode_throttle_reasons, make_gpu_probe


def _nvml_works() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.skipif(_nvml_works(), reason="this machine has a working NVML; the no-GPU path needs none")
def test_no_gpu_is_an_empty_list_not_an_error():
    probe = NvmlProbe()
    assert probe.device_count == 0 and probe.sample() == []
    probe.close()
    auto = make_gpu_probe()
    assert isinstance(auto, NoGpuProbe) and auto.sample() == []


class FakeNvml:
    """The pynvml functions NvmlProbe uses, over a table of devices."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's naming
        pass

    NVML_TEMPERATURE_GPU = 0

    def __init__(self, devices: list[dict], init_error: Exception | None = None) -> None:
        self.devices = devices
        self.init_error = init_error
        self.shutdowns = 0

    def nvmlInit(self) -> None:  # noqa: N802
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:  # noqa: N802
        return self.devices[i]

    def _get(self, h: dict, key: str):
        v = h[key]
        if isinstance(v, Exception):
            raise v
        return v

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        return SimpleNamespace(gpu=self._get(h, "util"), memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):  # noqa: N802
        used, total = self._get(h, "mem")
        return SimpleNamespace(used=used, total=total, free=total - used)

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        assert sensor == self.NVML_TEMPERATURE_GPU
        return self._get(h, "temp")

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):  # noqa: N802
        return self._get(h, "reasons")


def test_nvml_path_reads_every_field():
    nvml = FakeNvml(
        [
            {"util": 87, "mem": (30 << 30, 141 << 30), "temp": 64, "reasons": 0x0},
            {"util": 3, "mem": (1 << 30, 141 << 30), "temp": 81, "reasons": 0x4 | 0x40},
            {"util": 0, "mem": (0, 141 << 30), "temp": 30, "reasons": 0x1},
        ]
    )
    probe = NvmlProbe(nvml)
    a, b, c = probe.sample()
    assert (a.index, a.util, a.mem_used_bytes, a.mem_total_bytes, a.temp_c) == (
        0,
        0.87,
        30 << 30,
        141 << 30,
        64.0,
    )
    assert not a.throttled and a.throttle_reasons == ()
    assert b.throttled and b.throttle_reasons == ("sw_power_cap", "hw_thermal_slowdown")
    assert not c.throttled and c.throttle_reasons == ("gpu_idle",)  # idle is not a slowdown
    probe.close()
    assert nvml.shutdowns == 1 and probe.sample() == []


def test_unsupported_fields_are_none_and_a_lost_gpu_is_skipped():
    nvml = FakeNvml(
        [
            {
                "util": FakeNvml.NVMLError_NotSupported(),
                "mem": (5, 10),
                "temp": FakeNvml.NVMLError_NotSupported(),
                "reasons": FakeNvml.NVMLError_NotSupported(),
            },
            {"util": 1, "mem": FakeNvml.NVMLError("GPU is lost"), "temp": 1, "reasons": 0},
        ]
    )
    (only,) = NvmlProbe(nvml).sample()
    assert (only.index, only.util, only.temp_c, only.throttle_reasons) == (0, None, None, ())


def test_nvml_init_failure_means_no_gpus():
    probe = NvmlProbe(FakeNvml([{}], init_error=FakeNvml.NVMLError("Driver Not Loaded")))
    assert probe.device_count == 0 and probe.sample() == []


def test_unknown_throttle_bits_are_named_not_lost():
    assert decode_throttle_reasons(0x8 | 0x1000) == ("hw_slowdown", "bit_0x1000")
    assert decode_throttle_reasons(0) == ()


def test_the_node_record_gets_the_gpu_count_and_model_from_the_monitor():
    class Named(FakeNvml):
        def nvmlDeviceGetName(self, h):  # noqa: N802
            return self._get(h, "name")

    from elastic_rm.agent.monitor import ResourceMonitor

    nvml = Named([{"name": b"NVIDIA H200"}, {"name": b"NVIDIA H200"}])
    assert ResourceMonitor(gpu_probe=NvmlProbe(nvml)).gpu_inventory() == (2, "NVIDIA H200")
    broken = Named([{"name": FakeNvml.NVMLError("gone")}])
    assert ResourceMonitor(gpu_probe=NvmlProbe(broken)).gpu_inventory() == (1, "")
    assert ResourceMonitor(gpu_probe=None).gpu_inventory() == (0, "")
