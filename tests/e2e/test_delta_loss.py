"""A checkpoint at every step, made cheap by differential flash checkpoints, end to end: three ermrun
nodes train examples/dlrm/train.py --in-place --differential --checkpoint-every 1 on power-law ids;
one is SIGKILLed with its node memory. The survivors restore in place from a chain of deltas whose
lost shards come from the replicas the survivors hold, and lose at most the step in flight and the one
before it: a step counts as done (its progress row) once the previous step's save is committed on every
node, replica included, so when a rank has done step N the restore is at step N - 1 or later.
The state restored is the one logged at that step, every value, and each sample is trained once."""

from __future__ import annotations

import pytest

from elastic_rm.demo.checks import checks
from tests.e2e.test_closed_loop import (
    cleanup,  # noqa: F401 - a fixture
    steps_of,
)
from tests.e2e.test_inplace_loss import lose_a_member_of_three
from tests.e2e.test_inplace_rounds import assert_ledger_ok, pids_of

ARGS = ["--in-place", "--differential", "--checkpoint-every", "1", "--checksum-every", "1", "--zipf", "1.1"]


@pytest.mark.slow
def test_checkpoint_every_step_loses_only_the_saves_in_flight(etcd, tmp_path, cleanup):  # noqa: F811
    demo, victim, survivors, t_kill = lose_a_member_of_three(etcd, tmp_path, cleanup, ARGS)

    rows = demo.progress()
    for name in survivors:  # the same processes before and after the loss
        assert len(pids_of(rows, name)) == 1, f"{name} started new workers: {pids_of(rows, name)}"
    starts = [r for r in rows if r.get("start") and r["t"] > t_kill]
    assert {r["node"]: r["in_place"] for r in starts} == {n: True for n in survivors}, starts
    last = max(r["step"] for r in rows if "step" in r and r["world"] == 3)  # the newest any rank finished
    (step,) = {r["restored_step"] for r in starts}
    assert last - 1 <= step <= last, (step, last)
    logged = [r for r in rows if r.get("checksum_step") == step and r["world"] == 3]
    assert logged and len({r["checksum"] for r in logged}) == 1, logged
    for r in starts:  # every table row and both optimizers' state, as they were at that step
        assert r["checksum"] == logged[0]["checksum"], (r, logged[0])
    # a chain was restored (delta files, "<step>/<name>"), and every file came from a survivor
    files = {f: src for r in starts for f, (_, src) in r["restore_files"].items()}
    assert any("/" in f and f.endswith("_delta.erm") for f in files), sorted(files)
    allowed = {f"local:{n}" for n in survivors} | {f"peer:{n}" for n in survivors}
    assert {src.split("/")[0] for src in files.values()} <= allowed, files  # "/replica:<node>" held there
    lost = [src for r in starts for writer, src in r["restore_files"].values() if writer == victim]
    assert lost, [r["restore_files"] for r in starts]
    after = [r["step"] for r in steps_of(rows, world=2, since=t_kill)]
    assert after[0] == step + 1 and after == list(range(after[0], after[-1] + 1))
    assert_ledger_ok(rows)
    assert all(c["ok"] for c in checks(rows)), [c for c in checks(rows) if not c["ok"]]
