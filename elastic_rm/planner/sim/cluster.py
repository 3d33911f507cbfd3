"""Machines of a shared cluster and first-fit allocation of node slices (cores, memory, GPUs)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class ClusterSpec:
    machines: int = 48
    cores: float = 96.0
    mem_gib: float = 768.0
    gpus: int = 8

    @property
    def total(self) -> tuple[float, float, float]:
        return (
            self.machines * self.cores,
            self.machines * self.mem_gib * GIB,
            float(self.machines * self.gpus),
        )


class Cluster:
    """Free capacity per machine; a slice lives on one machine."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.free = [[spec.cores, spec.mem_gib * GIB, float(spec.gpus)] for _ in range(spec.machines)]

    def fits(self, machine: int, cpu: float, mem: float, gpus: int) -> bool:
        f = self.free[machine]
        return f[0] >= cpu - 1e-9 and f[1] >= mem - 1 and f[2] >= gpus

    def allocate(self, cpu: float, mem: float, gpus: int) -> int | None:
        """First fit; the machine index or None."""
        for i in range(len(self.free)):
            if self.fits(i, cpu, mem, gpus):
                self._take(i, cpu, mem, gpus)
                return i
        return None

    def _take(self, i: int, cpu: float, mem: float, gpus: int) -> None:
        f = self.free[i]
        f[0] -= cpu
        f[1] -= mem
        f[2] -= gpus

    def release(self, i: int, cpu: float, mem: float, gpus: int) -> None:
        self._take(i, -cpu, -mem, -gpus)

    def resize(self, i: int, old: tuple[float, float], new: tuple[float, float]) -> bool:
        """Change a slice's cores/memory in place if the machine has room."""
        dc, dm = new[0] - old[0], new[1] - old[1]
        if self.free[i][0] >= dc - 1e-9 and self.free[i][1] >= dm - 1:
            self._take(i, dc, dm, 0)
            return True
        return False

    def can_fit_count(self, cpu: float, mem: float, gpus: int) -> int:
        """Slices of this size that fit, with ``fits``'s tolerance: freed capacity comes back through float
        sums, so an empty machine can hold a few bytes less than its size, and a slice of a whole machine
        would never fit again."""
        n = 0
        for f in self.free:
            k = min(
                (f[0] + 1e-9) // max(cpu, 1e-9), (f[1] + 1) // max(mem, 1), f[2] // gpus if gpus else 1 << 30
            )
            n += int(max(k, 0))
        return n
