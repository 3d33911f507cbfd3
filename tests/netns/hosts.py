"""Hosts as Linux network namespaces on one machine: a bridge in the root namespace (where etcd listens on
the bridge's address), one namespace per host joined to it by a veth pair, each host its own address. Real
network faults: a host's link down and up, its TCP connections reset. Needs root and `ip netns`;
`why_unavailable()` says why not, for the tests' skip reason."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass

import psutil

OWNER = "elastic-rm test network of pid "  # the bridge's alias: whose network it is


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

    def blackhole(self, addr: str) -> None:
        """This host stops reaching `addr` (its packets there go nowhere); everyone else is unaffected: one
        side of an asymmetric partition."""
        _ip("-n", self.netns, "route", "add", "blackhole", f"{addr}/32")

    def unblackhole(self, addr: str) -> None:
        _ip("-n", self.netns, "route", "del", "blackhole", f"{addr}/32")

    def lossy(self, probability: float) -> None:
        """Lose `probability` of the packets each way on this host's link (see `drop_randomly`)."""
        drop_randomly("eth0", probability, self.netns)
        drop_randomly(self.link, probability)

    def lossless(self) -> None:
        _tc(self.netns, "qdisc", "del", "dev", "eth0", "root")
        _tc(None, "qdisc", "del", "dev", self.link, "root")

    def packets(self) -> tuple[int, int]:
        """(sent, dropped) on this host's link, both ways together."""
        a, b = dropped("eth0", self.netns), dropped(self.link)
        return a[0] + a[1] + b[0] + b[1], a[1] + b[1]

    def reset_connections(self) -> None:
        """Destroy the host's TCP connections (ss -K), as a stateful firewall or NAT on the path that
        forgot them during an outage would: the host's clients must reconnect."""
        subprocess.run(
            ["ip", "netns", "exec", self.netns, "ss", "-K", "state", "established"],
            check=True,
            capture_output=True,
            timeout=30,
        )


def _tc(netns: str | None, *args: str) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "tc", *args], check=True, capture_output=True, timeout=30)


def drop_randomly(dev: str, probability: float, netns: str | None = None) -> None:
    """Drop each packet leaving `dev` with `probability`, without sch_netem (not in every kernel): an htb
    root whose default class passes everything, a classic-BPF filter that picks packets by the kernel's
    random number (`ld rand`) and sends them to a class whose queue holds nothing (pfifo limit 0)."""
    threshold = int(probability * 2**32)
    prog = f"4,32 0 0 {2**32 - 0x1000 + 56},53 0 1 {threshold},6 0 0 0,6 0 0 {2**32 - 1}"  # rand<t: -1
    _tc(netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10", "r2q", "100000")
    for cls in ("1:10", "1:20"):
        _tc(netns, "class", "add", "dev", dev, "parent", "1:", "classid", cls, "htb", "rate", "10gbit")
    _tc(netns, "qdisc", "add", "dev", dev, "parent", "1:20", "handle", "20:", "pfifo", "limit", "0")
    _tc(
        netns,
        "filter",
        "add",
        "dev",
        dev,
        "parent",
        "1:",
        "protocol",
        "all",
        "prio",
        "1",
        "bpf",
        "bytecode",
        prog,
        "classid",
        "1:20",
    )


def dropped(dev: str, netns: str | None = None) -> tuple[int, int]:
    """(packets sent, packets dropped) by `dev`'s root qdisc, from `tc -s qdisc`."""
    prefix = ["ip", "netns", "exec", netns] if netns else []
    out = subprocess.run(
        [*prefix, "tc", "-s", "qdisc", "show", "dev", dev, "root"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    words = out.split()
    sent = int(words[words.index("Sent") + 3])
    drops = int(words[words.index("(dropped") + 1].rstrip(","))
    return sent, drops


def remove_leaked_networks() -> list[str]:
    """Remove the networks (bridge, hosts, veths) of test processes that are gone without their cleanup (a
    run killed by a timeout): a leaked bridge keeps its subnet's route, and a new network on that subnet
    then reaches nothing. Only bridges whose alias names a dead owner are touched. Returns their names."""
    bridges = json.loads(_ip("-j", "link", "show", "type", "bridge").stdout or "[]")
    namespaces = _ip("netns", "list").stdout.split()
    removed = []
    for b in bridges:
        alias, name = b.get("ifalias") or "", b["ifname"]
        ours = name.startswith("ermbr") and alias.startswith(OWNER)
        if not ours or psutil.pid_exists(int(alias[len(OWNER) :])):
            continue
        tag = name[len("ermbr") :]
        for ns in namespaces:
            if re.fullmatch(f"erm{tag}h\\d+", ns):
                _ip("netns", "del", ns, check=False)
        _ip("link", "del", name, check=False)
        removed.append(name)
    return removed


def _free_subnet(start: int) -> int:
    """The first k from `start` (of 10..249) that no address here uses as 10.213.<k>.x."""
    used = {int(k) for k in re.findall(r"inet 10\.213\.(\d+)\.", _ip("-o", "-4", "addr", "show").stdout)}
    for i in range(240):
        k = 10 + (start - 10 + i) % 240
        if k not in used:
            return k
    raise RuntimeError("every 10.213.<k>.0/24 test subnet is in use here: remove the stale ermbr* bridges")


class Network:
    """A bridge and `n` hosts on 10.213.<k>.0/24 (the bridge .1, host i .(10+i)), on a subnet no other
    address here uses. Removed on exit, and by the next network if this process dies first."""

    def __init__(self, n: int) -> None:
        self.tag = secrets.token_hex(2)
        self.subnet = 10 + int(self.tag, 16) % 240
        self.bridge = f"ermbr{self.tag}"
        self.gateway = f"10.213.{self.subnet}.1"
        self.hosts: list[Host] = []
        self._n = n

    def __enter__(self) -> Network:
        remove_leaked_networks()
        self.subnet = _free_subnet(self.subnet)
        self.gateway = f"10.213.{self.subnet}.1"
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "alias", f"{OWNER}{os.getpid()}")
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
        for ns in (["-n", netns], []):  # one wire packet per skb (no GSO), so a drop is one packet lost
            _ip(*ns, "link", "set", "eth0" if ns else link, "gso_max_segs", "1")
        return Host(f"h{i}", netns, addr, link)

    def close(self) -> None:
        for i in range(self._n):
            _ip("netns", "del", f"erm{self.tag}h{i}", check=False)  # takes its veth pair with it
            _ip("link", "del", f"ermv{self.tag}{i}", check=False)
        _ip("link", "del", self.bridge, check=False)

    def __exit__(self, *exc: object) -> None:
        self.close()
