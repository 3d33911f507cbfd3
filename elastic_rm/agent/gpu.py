"""Per-GPU utilisation, memory, temperature and throttle reasons through NVML (nvidia-ml-py).

The monitor asks a :class:`GpuProbe` for one sample per tick. A node without GPUs, a driver or the NVML
library is a normal case, not an error: :func:`make_gpu_probe` then returns a probe whose samples are the
empty list. Indices are NVML's (physical, not renumbered by ``CUDA_VISIBLE_DEVICES``): the agent watches
the whole node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

log = logging.getLogger(__name__)

# NVML clock-event ("throttle") reason bits, as in nvml.h; named here so that a pynvml without a
# constant still decodes the mask.
THROTTLE_REASON_BITS: tuple[tuple[int, str], ...] = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)
# Reasons that mean the GPU runs slower than it could under load. Idle, a user clock setting, sync boost
# and the display clock are not slowdowns the planner should react to.
SLOWDOWN_REASONS = frozenset(
    {"sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown"}
)


@dataclass(frozen=True)
class GpuSample:
    """One GPU at one instant. ``util``/``temp_c`` are None where the device does not report them (MIG)."""

    index: int
    util: float | None  # 0..1, kernel-busy fraction over NVML's last sample period
    mem_used_bytes: int
    mem_total_bytes: int
    temp_c: float | None
    throttle_reasons: tuple[str, ...] = ()

    @property
    def throttled(self) -> bool:
        return any(r in SLOWDOWN_REASONS for r in self.throttle_reasons)


def decode_throttle_reasons(mask: int) -> tuple[str, ...]:
    """Names of the set bits of an NVML clock-event mask; unknown bits appear as ``bit_0x...``."""
    # NVML's mask is an unsigned long long; a negative int (a wrapper's -1 for "unknown") has endless
    # set bits and made the loop below spin forever, hanging the monitor's sampling thread
    mask &= (1 << 64) - 1
    names = [name for bit, name in THROTTLE_REASON_BITS if mask & bit]
    known = 0
    for bit, _ in THROTTLE_REASON_BITS:
        known |= bit
    rest = mask & ~known
    bit = 1
    while rest:
        if rest & bit:
            names.append(f"bit_{bit:#x}")
            rest &= ~bit
        bit <<= 1
    return tuple(names)


class GpuProbe(Protocol):
    """Something that samples the node's GPUs. ``sample`` never raises; no GPU is ``[]``."""

    def sample(self) -> list[GpuSample]: ...

    def close(self) -> None: ...


class NoGpuProbe:
    """The probe of a node without usable GPUs."""

    def sample(self) -> list[GpuSample]:
        return []

    device_count = 0

    def model(self) -> str:
        return ""

    def close(self) -> None:
        return None


class NvmlProbe:
    """Samples every GPU NVML sees. ``nvml`` is the pynvml module (or an object with its functions).

    Initialisation failures (no library, no driver, no device) leave the probe empty. Per-field failures
    (a field the device does not support) give None for that field; a device that fails entirely (fell
    off the bus) is skipped for that sample and logged once.
    """

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[int, Any]] = []
        self._warned: set[int] = set()
        try:
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py; pure Python, loads libnvidia-ml lazily
            nvml.nvmlInit()
        except Exception as exc:  # any NVML/import failure means "no GPU here"
            log.debug("NVML unavailable, monitoring no GPUs: %s", exc)
            return
        self._nvml = nvml
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as exc:
            log.warning("NVML initialised but listing GPUs failed, monitoring none: %s", exc)
            count = 0
        for i in range(count):  # one lost GPU must not hide the others (and the node's GPU count)
            try:
                self._handles.append((i, nvml.nvmlDeviceGetHandleByIndex(i)))
            except Exception as exc:
                log.warning("GPU %d does not answer NVML (%s); leaving it out of the metrics", i, exc)
        self._reasons_fn = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        self._temp_sensor = getattr(nvml, "NVML_TEMPERATURE_GPU", 0)

    @property
    def device_count(self) -> int:
        return len(self._handles)

    def model(self) -> str:
        """The first GPU's product name ("" when NVML does not say); the node record carries it."""
        if not self._handles:
            return ""
        try:
            name = self._nvml.nvmlDeviceGetName(self._handles[0][1])
        except Exception:
            return ""
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def sample(self) -> list[GpuSample]:
        out: list[GpuSample] = []
        for index, handle in self._handles:
            try:
                mem = self._nvml.nvmlDeviceGetMemoryInfo(handle)
                used, total = int(mem.used), int(mem.total)
            except Exception as exc:  # a lost device must not stop the monitor
                if index not in self._warned:
                    self._warned.add(index)
                    log.warning(
                        "GPU %d stopped answering NVML (%s); leaving it out of the metrics", index, exc
                    )
                continue
            util = self._field(lambda h: self._nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100.0, handle)
            temp = self._field(
                lambda h: float(self._nvml.nvmlDeviceGetTemperature(h, self._temp_sensor)), handle
            )
            mask = self._field(lambda h: int(self._reasons_fn(h)) if self._reasons_fn else 0, handle)
            out.append(
                GpuSample(
                    index=index,
                    util=None if util is None else min(max(float(util), 0.0), 1.0),
                    mem_used_bytes=used,
                    mem_total_bytes=total,
                    temp_c=temp,
                    throttle_reasons=decode_throttle_reasons(mask or 0),
                )
            )
        return out

    def _field(self, read: Any, handle: Any) -> Any:
        try:
            return read(handle)
        except Exception:  # NotSupported and friends: the field is unknown
            return None

    def close(self) -> None:
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass
            self._nvml = None
            self._handles = []


def make_gpu_probe() -> GpuProbe:
    """The real probe when NVML finds at least one GPU, else a :class:`NoGpuProbe`."""
    probe = NvmlProbe()
    if probe.device_count == 0:
        probe.close()
        return NoGpuProbe()
    return probe
