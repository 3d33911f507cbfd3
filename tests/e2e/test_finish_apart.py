"""Nodes that finish apart (elastic_rm.agent.finish): a node whose workers fail after the other node's
succeeded does not wait the membership grace for a new round (the other node is in torch's exit barrier:
the job ends, its membership does not change), and the node in the exit barrier leaves it when the failing
node closes the run, not after torch's 300 s. Otherwise the first would wait --membership-grace (here
600 s) and the second up to 300 s, past this test's wait."""

from __future__ import annotations

import json
import os

from elastic_rm.etcd.client import EtcdClient
from tests.conftest import REPO, Proc
from tests.e2e.exits import exit_codes
from tests.ermrun_argv import ermrun_argv, node_args

FINISH_APART = os.path.join(REPO, "tests", "workers", "finish_apart.py")


def test_a_node_failing_after_its_peer_finished_ends_both_agents_at_once(etcd, run_id, tmp_path, procs):
    nodes = {}
    for name in ("a", "b"):
        node = node_args(etcd.endpoint, run_id, "2", name)
        argv = ermrun_argv(*node, FINISH_APART, monitor_interval=0.1, membership_grace=600, spares="off")
        nodes[name] = Proc(argv, str(tmp_path / f"{name}.log"))
    procs.extend(nodes.values())
    codes = exit_codes(nodes, 120)
    with EtcdClient(etcd.endpoint) as client:
        round_ = json.loads(client.get(f"/elastic-rm/{run_id}/round").value)
        closed = json.loads(client.get(f"/elastic-rm/{run_id}/closed").value)
    failing = round_["members"][1]  # group rank 1 fails
    finished = round_["members"][0]
    assert codes[finished] == 0 and codes[failing] not in (0, None), {
        n: p.output()[-3000:] for n, p in nodes.items()
    }
    assert closed["by"] == failing, closed  # the failing node closed the run as it exited
    assert (
        "exit barrier left after" in nodes[finished].output()
        and f"closed (by {failing})" in nodes[finished].output()
    )
