"""Hosts as Linux network namespaces on one machine: a bridge in the root namespace (where etcd listens on
the bridge's address), one namespace per host joined to it by a veth pair, each host its own address. Real
network faults: a host's link down and up, its TCP connections reset. Needs root and `ip netns`;
`why_unavailable()` says why not, for the tests' skip reason."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def why_unavailable() -> str | None:
    """None when namespaces can be made here, else the reason (printed as the skip reason)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root (ip netns add)"
    for tool in ("ip", "ss"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need the {tool!r} command (iproute2)"
    probe = f"ermprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    netns: str
    addr: str
    link: str  # the veth end in the root namespace: down = the host is cut off from everyone

    def argv(self, argv: list[str]) -> list[str]:
        """A command run inside this host's namespace (ip netns exec keeps the pid and the environment)."""
        return ["ip", "netns", "exec", self.netns, *argv]

    def link_down(self) -> None:
        _ip("link", "set", self.link, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.link, "up")

    def reset_connections(self) -> None:
        """Destroy the host's TCP connections (ss -K), as a stateful firewall or NAT on the path that
        forgot them during an outage would: the host's clients must reconnect."""
        subprocess.run(["ip", "netns", "exec", self.netns, "ss", "-K", "state", "established"],
                       check=True, capture_output=True, timeout=30)  # fmt: skip


class Network:
    """A bridge and `n` hosts on 10.213.<k>.0/24 (the bridge .1, host i .(10+i)). Removed on exit."""

    def __init__(self, n: int) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = 10 + int(self.tag, 16) % 240
        self.bridge = f"ermbr{self.tag}"
        self.gateway = f"10.213.{self.subnet}.1"
        self.hosts: list[Host] = []
        self._n = n

    def __enter__(self) -> Network:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i in range(self._n):
                self.hosts.append(self._add_host(i))
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, i: int) -> Host:
        netns, link, addr = f"erm{self.tag}h{i}", f"ermv{self.tag}{i}", f"10.213.{self.subnet}.{10 + i}"
        _ip("netns", "add", netns)
        _ip("link", "add", link, "type", "veth", "peer", "name", f"ermp{self.tag}{i}")
        _ip("link", "set", f"ermp{self.tag}{i}", "netns", netns)
        _ip("-n", netns, "link", "set", f"ermp{self.tag}{i}", "name", "eth0")
        _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", "eth0")
        _ip("-n", netns, "link", "set", "eth0", "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        _ip("link", "set", link, "master", self.bridge)
        _ip("link", "set", link, "up")
        return Host(f"h{i}", netns, addr, link)

    def close(self) -> None:
        for i in range(self._n):
            _ip("netns", "del", f"erm{self.tag}h{i}", check=False)  # takes its veth pair with it
            _ip("link", "del", f"ermv{self.tag}{i}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()
