"""The hosts `erm launch` knows: free, busy (a node runs there) or blacklisted for a cooldown.

As Horovod's elastic driver does: a host whose node fails ``failures_to_blacklist`` times in a row is left
alone for a cooldown, doubled each time it is blacklisted again (up to ``max_cooldown_s``), then tried
again. A node that came up (registered in etcd) resets its host's count: only repeated failures to run
count, not a job that was long healthy there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .hostfile import Host


@dataclass
class HostState:
    host: Host
    busy: bool = False
    failures: int = 0  # consecutive failures
    strikes: int = 0  # times blacklisted
    blacklisted_until: float = 0.0
    last_error: str = ""


class HostPool:
    def __init__(
        self,
        failures_to_blacklist: int = 2,
        cooldown_s: float = 60.0,
        max_cooldown_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        if failures_to_blacklist < 1:
            raise ValueError(f"--host-failures must be >= 1, got {failures_to_blacklist}")
        if not 0 <= cooldown_s <= max_cooldown_s:  # also NaN, which blacklisted a host for good
            raise ValueError("--blacklist-cooldown must be >= 0 and <= the maximum cooldown")
        self.failures_to_blacklist = failures_to_blacklist
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._hosts: dict[str, HostState] = {}

    def __contains__(self, name: str) -> bool:
        return name in self._hosts

    def __len__(self) -> int:
        return len(self._hosts)

    def get(self, name: str) -> HostState:
        return self._hosts[name]

    def names(self) -> list[str]:
        return list(self._hosts)

    def add(self, host: Host) -> None:
        """A new host (or a changed one: its address, port or slots are replaced, its history kept)."""
        state = self._hosts.get(host.name)
        if state is None:
            self._hosts[host.name] = HostState(host)
        else:
            state.host = host

    def remove(self, name: str) -> None:
        self._hosts.pop(name, None)

    def blacklisted(self, name: str) -> bool:
        return self._hosts[name].blacklisted_until > self._clock()

    def free(self) -> list[Host]:
        """Hosts a node may start on now, in hostfile (or discovery) order."""
        now = self._clock()
        return [s.host for s in self._hosts.values() if not s.busy and s.blacklisted_until <= now]

    def take(self, name: str) -> None:
        self._hosts[name].busy = True

    def release(self, name: str) -> None:
        """The node on this host is gone; the host is free again (unless it was removed meanwhile)."""
        if name in self._hosts:
            self._hosts[name].busy = False

    def succeeded(self, name: str) -> None:
        if name in self._hosts:
            self._hosts[name].failures = 0

    def failed(self, name: str, error: str) -> float | None:
        """Count a failure; returns the cooldown in seconds when the host is blacklisted by it."""
        state = self._hosts.get(name)
        if state is None:
            return None
        state.failures += 1
        state.last_error = error
        if state.failures < self.failures_to_blacklist:
            return None
        state.strikes += 1
        state.failures = 0
        # the exponent bounded: a float cooldown times 2**1024 or more raises OverflowError, which ended a
        # long run (and stopped its nodes) at a host's 1025th blacklisting; 2**1000 is past any maximum
        cooldown = min(self.cooldown_s * 2 ** min(state.strikes - 1, 1000), self.max_cooldown_s)
        state.blacklisted_until = self._clock() + cooldown
        return cooldown

    def blacklist(self, name: str, error: str) -> float:
        """Blacklist now, without waiting for repeated failures (the scheduler took the node away); the
        cooldown in seconds."""
        state = self._hosts[name]
        state.failures = self.failures_to_blacklist - 1
        return self.failed(name, error) or 0.0

    def expired_blacklist(self) -> list[Host]:
        """Hosts whose cooldown just ended (each reported once)."""
        now = self._clock()
        done = []
        for s in self._hosts.values():
            if 0 < s.blacklisted_until <= now:
                s.blacklisted_until = 0.0
                done.append(s.host)
        return done
