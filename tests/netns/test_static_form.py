"""torchrun's static multi-node form across two hosts with their own addresses: node rank 0's etcd
listens on every interface and the other host reaches it at --master-addr (tests/launch/test_static_form.py
runs the form on loopback in CI)."""

from __future__ import annotations

import pytest

from elastic_rm.demo.harness import jsonl_rows
from tests.conftest import Proc
from tests.e2e.helpers import STEPS
from tests.ermrun_argv import ermrun_argv
from tests.netns.hosts import Network, why_unavailable

UNAVAILABLE = why_unavailable()
pytestmark = [pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE)), pytest.mark.slow]


def test_the_static_form_joins_hosts_through_node_rank_0s_address(tmp_path):
    progress = tmp_path / "progress"
    progress.mkdir()
    with Network(2) as net:
        head, other = net.hosts
        nodes = []
        for rank, host in ((1, other), (0, head)):  # the joining host first: it waits for the head
            argv = ermrun_argv(
                STEPS,
                nnodes=2,
                node_rank=rank,
                master_addr=head.addr,
                master_port=29500,
                local_addr=host.addr,
                node_id=host.name,
                spares="off",
                monitor_interval=0.1,
            )
            env = {"STEPS_DIR": str(progress), "STEPS_NODE": host.name, "STEPS_MAX": "3"}
            env |= {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            nodes.append(Proc(host.argv(argv), str(tmp_path / f"{host.name}.log"), env=env))
        try:
            for p in nodes:
                assert p.wait(180) == 0, p.output()[-3000:]
        finally:
            for p in nodes:
                p.stop()
    starts = [r for f in sorted(progress.glob("*.jsonl")) for r in jsonl_rows(str(f)) if r.get("start")]
    assert sorted(r["rank"] for r in starts) == [0, 1] and {r["world"] for r in starts} == {2}
