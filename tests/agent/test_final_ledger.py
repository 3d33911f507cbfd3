"""The ledger in etcd ends at the job's final checkpoint, however the metrics loop's polls fall.

The leader's metrics loop mirrors the newest committed checkpoint's ledger once a second; a checkpoint
committed in the job's last second (the final drain's, a worker's last save) can land after the loop's
last poll, and the loop stops with the agent. Here the loop is set never to poll (its interval an hour):
the interleaving where every poll came before the final commit. A real etcd, a real ermrun agent, one
worker that commits a checkpoint carrying a sample ledger and exits 0.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from elastic_rm.checkpoint.node_memory import ENV_MEMORY_ROOT
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import LedgerRecord
from tests.conftest import Proc
from tests.ermrun_argv import flags

FINAL_STEP = 17

WORKER = """
import os, sys
from pathlib import Path
from elastic_rm.train.ledger import GlobalBatches, RangeLedger
from elastic_rm.checkpoint.manifest import make_manifest, step_dirname
from elastic_rm.checkpoint.node_memory import run_memory_dir

step = int(sys.argv[1])
batches = GlobalBatches(RangeLedger(320, 32), 8)
for _ in range(step):
    batches.next()
    batches.consumed()
node = os.environ["ERM_NODE_ID"]
d = run_memory_dir(os.environ["TORCHELASTIC_RUN_ID"]) / node / step_dirname(step)
d.mkdir(parents=True)
position = {"step": step, "ledger": batches.ledger.checkpoint_state()}
body = {"step": step, "world_size": 1, "nodes": [node], "position": position, "files": {}}
(d / "manifest.json").write_bytes(make_manifest(body))
"""

# ermrun with the metrics loop's interval at an hour: it never polls the ledger while the job runs
AGENT = """
import sys
import elastic_rm.agent.agent as agent
agent.PUBLISH_INTERVAL_S = 3600.0
from launcher.ermrun import main
main(sys.argv[1:])
"""


def test_the_ledger_in_etcd_is_the_final_checkpoints_when_no_poll_came_after_it(
    etcd, run_id, tmp_path: Path, procs
) -> None:
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    ermrun_flags = flags(
        nnodes=1,
        nproc_per_node=1,
        rdzv_endpoint=etcd.endpoint,
        rdzv_id=run_id,
        node_id="a",
        monitor_interval=0.1,
        spares="off",
    )
    argv = [sys.executable, "-c", AGENT, *ermrun_flags, worker.as_posix(), str(FINAL_STEP)]
    memory = tmp_path / "memory"
    env = {ENV_MEMORY_ROOT: str(memory), "PYTHONPATH": os.getcwd()}
    agent = Proc(argv, str(tmp_path / "a.agent.log"), env=env)
    procs.append(agent)
    assert agent.wait(120) == 0, agent.output()[-3000:]
    assert not (memory / run_id).exists(), "the node memory is freed at the job's end"
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint, timeout=5) as client:
        kv = client.get(keys.ledger)
    assert kv is not None, "no ledger in etcd: the final checkpoint's was never mirrored"
    ledger = LedgerRecord.parse(keys.ledger, kv.value)
    assert (ledger.step, ledger.node, ledger.samples_done) == (FINAL_STEP, "a", FINAL_STEP * 8)
