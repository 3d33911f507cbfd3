"""An etcd cluster whose members are hosts of a `Network`: each member runs in its own namespace on its
own address, so cutting that host's link partitions the member from the others and from every client
(the raft leader's link down makes the other two elect a new leader). Members are stopped by pid."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from dataclasses import dataclass

from elastic_rm.etcd.server import find_etcd_binary, member_command
from tests.conftest import Proc
from tests.netns.hosts import Host

CLIENT_PORT, PEER_PORT = 2379, 2380
FAST_ELECTION = ["--heartbeat-interval", "50", "--election-timeout", "500", "--log-level", "error"]


@dataclass(frozen=True)
class Status:
    member_id: int
    leader: int


def status(endpoint: str) -> Status | None:
    """etcd's Maintenance.Status over its HTTP gateway: which member answers and whom it follows."""
    req = urllib.request.Request(f"http://{endpoint}/v3/maintenance/status", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=1) as r:
            d = json.loads(r.read())
    except (OSError, ValueError):
        return None
    return Status(int(d["header"]["member_id"]), int(d.get("leader", 0)))


class NetnsEtcd:
    """Three (or `len(hosts)`) etcd members, member i on hosts[i]. Removed on exit."""

    def __init__(self, hosts: list[Host], data_dir: str, extra_args: list[str] = ()) -> None:
        self.hosts = hosts
        self.data_dir = data_dir
        self.extra_args = list(extra_args)
        self.procs: list[Proc] = []

    @property
    def endpoints(self) -> list[str]:
        return [f"{h.addr}:{CLIENT_PORT}" for h in self.hosts]

    @property
    def endpoint(self) -> str:
        return ",".join(self.endpoints)

    def __enter__(self) -> NetnsEtcd:
        binary = find_etcd_binary()
        peers = ",".join(f"{h.name}=http://{h.addr}:{PEER_PORT}" for h in self.hosts)
        try:
            for h in self.hosts:
                cmd = member_command(
                    binary,
                    h.name,
                    os.path.join(self.data_dir, h.name),
                    h.addr,
                    h.addr,
                    CLIENT_PORT,
                    PEER_PORT,
                    initial_cluster=peers,
                    token=f"erm-netns-{os.getpid()}",
                )
                log = os.path.join(self.data_dir, f"{h.name}.etcd.log")
                self.procs.append(Proc(h.argv(cmd + FAST_ELECTION + self.extra_args), log))
            self.wait_leader(30)
        except BaseException:
            self.close()
            raise
        return self

    def wait_leader(self, timeout: float, among: list[int] | None = None) -> int:
        """Index of the member that leads, as the members in `among` (default all) agree; waits for one."""
        among = list(range(len(self.hosts))) if among is None else among
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = {i: status(self.endpoints[i]) for i in among}
            ids = {i: s.member_id for i, s in seen.items() if s is not None}
            leaders = {s.leader for s in seen.values() if s is not None}
            if len(ids) == len(among) and len(leaders) == 1:
                lead = next(iter(leaders))
                match = [i for i, m in ids.items() if m == lead]
                if match:
                    return match[0]
            time.sleep(0.1)
        raise AssertionError(f"members {among} agreed on no raft leader within {timeout}s")

    def close(self) -> None:
        for p in self.procs:
            p.stop()

    def __exit__(self, *exc: object) -> None:
        self.close()
