"""When a node's metrics record is worth an etcd write: on a change beyond a band, or as a heartbeat.

Why: the agent builds a record a second. At 1,000 nodes, writing every one is 1,000 etcd writes a second,
each delivered to the leader's watch and parsed there, while a node under a steady load repeats the same
figures within a few percent. The leader (and the planner, which samples the latest record at most every
``sample_interval_s``) needs the latest figures within the band, not every second's copy.

A record is published when any number in it moved by more than ``band`` relative to the last published
one (a utilisation also by more than ``floor`` absolute, so that values near zero do not flap), when its
shape changed (steps appeared or went, a worker or GPU came or went, a GPU started throttling), or when
``heartbeat_s`` passed since the last publication. Fields that change on every record by construction (``t``,
``steps.age_s``, ``steps.steps``) are not compared.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_BAND = 0.05  # relative change that counts as news
DEFAULT_FLOOR = 0.02  # utilisations (0..1) must also move this much: an idle node's 0.001 -> 0.002 is no news
DEFAULT_HEARTBEAT_S = 10.0  # publish at least this often (the leader's copy is never older)
IGNORED = frozenset({"t", "age_s"})  # change on every record
EXACT = frozenset({"pid", "index", "node", "v"})  # identities: any change is news
FRACTIONS = frozenset({"util_mean", "util_max", "util_last", "util", "cpu_util"})  # 0..1 (or cores): floored


def _ignored(parent: str, key: str) -> bool:
    """``t`` and ``age_s`` anywhere, and ``steps.steps`` (a count of steps in the window)."""
    return key in IGNORED or (parent == "steps" and key == "steps")


def changed(
    old: Any, new: Any, band: float = DEFAULT_BAND, floor: float = DEFAULT_FLOOR, key: str = ""
) -> bool:
    """Whether ``new`` differs from ``old`` beyond the band anywhere (JSON-like values)."""
    if isinstance(new, bool) or isinstance(old, bool) or new is None or old is None:
        return old != new
    if isinstance(new, (int, float)) and isinstance(old, (int, float)):
        if key in EXACT or not (math.isfinite(old) and math.isfinite(new)):
            return old != new
        diff = abs(new - old)
        return diff > band * max(abs(old), abs(new)) and (key not in FRACTIONS or diff > floor)
    if isinstance(new, dict) and isinstance(old, dict):
        if new.keys() != old.keys():
            return True
        return any(changed(old[k], new[k], band, floor, k) for k in new if not _ignored(key, k))
    if isinstance(new, list) and isinstance(old, list):
        return len(new) != len(old) or any(
            changed(a, b, band, floor, key) for a, b in zip(old, new, strict=True)
        )
    return old != new


class PublishGate:
    """Decides, record by record, which of a node's metrics records go to etcd (see the module doc)."""

    def __init__(
        self,
        band: float = DEFAULT_BAND,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        floor: float = DEFAULT_FLOOR,
    ):
        if not band >= 0 or not heartbeat_s > 0 or not floor >= 0:
            raise ValueError(
                f"metrics gate: band >= 0, heartbeat_s > 0, floor >= 0; got {band}, {heartbeat_s}, {floor}"
            )
        self.band, self.heartbeat_s, self.floor = band, heartbeat_s, floor
        self._last: dict[str, Any] | None = None
        self._last_at = -math.inf

    def due(self, record: dict[str, Any], now: float) -> bool:
        """True when ``record`` should be published now; the caller then calls :meth:`published`."""
        if self._last is None or now - self._last_at >= self.heartbeat_s:
            return True
        return changed(self._last, record, self.band, self.floor)

    def published(self, record: dict[str, Any], now: float) -> None:
        self._last, self._last_at = record, now

    def reset(self) -> None:
        """Publish the next record whatever it holds (a new round, a new lease)."""
        self._last, self._last_at = None, -math.inf
