"""The short API's documented form keeps the survivors' processes after a member's loss; the form that
cannot says so when the job starts (on the console of each of its nodes), not after the first loss."""

from __future__ import annotations

import os
import re
import signal

import pytest

from elastic_rm.train.rounds import OUTSIDE_WARNING
from tests.conftest import REPO, Proc
from tests.e2e.helpers import records, wait_until
from tests.ermrun_argv import ermrun_argv, node_args

SCRIPT = os.path.join(REPO, "tests", "workers", "short_form.py")


def _node(etcd, run_id: str, tmp_path, name: str, form: str, nnodes: str = "1:2", **env: str) -> Proc:
    argv = ermrun_argv(
        *node_args(etcd.endpoint, run_id, nnodes, name),
        SCRIPT,
        monitor_interval=0.1,
        log_dir=tmp_path / f"logs-{name}",
    )
    env = {"STEPS_DIR": str(tmp_path), "STEPS_NODE": name, "SHORT_FORM": form, **env}
    return Proc(argv, str(tmp_path / f"{name}.log"), env=env)


def _rows(tmp_path, node: str, world: int) -> list[dict]:
    return [r for r in records(tmp_path, node) if r.get("world") == world]


# 14 s; CI keeps the survivors' processes after a loss in tests/e2e/test_inplace_loss.py
@pytest.mark.slow
def test_elastic_run_keeps_the_survivors_process_and_the_for_form_warns_at_start(
    etcd, run_id, tmp_path, procs
):
    a = _node(etcd, run_id, tmp_path, "a", "run")  # elastic_run(train)
    b = _node(etcd, run_id, tmp_path, "b", "for")  # for _ in elastic_rounds(): train()
    procs.extend([a, b])
    wait_until(
        lambda: len(_rows(tmp_path, "a", 2)) >= 10 and len(_rows(tmp_path, "b", 2)) >= 10,
        180,
        "both nodes training at world 2",
        [a, b],
    )
    assert OUTSIDE_WARNING in b.output(), b.output()[-3000:]  # at the start, before any loss
    assert OUTSIDE_WARNING not in a.output(), a.output()[-3000:]

    b.signal(signal.SIGKILL)
    wait_until(lambda: len(_rows(tmp_path, "a", 1)) >= 10, 180, "node a training alone", [a])
    assert {r["pid"] for r in records(tmp_path, "a")} == {_rows(tmp_path, "a", 2)[0]["pid"]}  # one process
    console = a.output()  # a recovery is one line on the console; the traceback is in the log directory
    assert len(re.findall(r"peer lost; round \d+ in place, training again after", console)) == 1, console
    assert "Traceback" not in console and "failed on rank" in console, console
    held = list((tmp_path / "logs-a").rglob("held_failures.log"))
    assert len(held) == 1 and "Traceback (most recent call last)" in held[0].read_text(), held
    (tmp_path / "stop").touch()
    assert a.wait(60) == 0, a.output()[-3000:]


def test_a_global_batch_that_a_world_of_nnodes_cannot_split_is_refused_at_the_first_round(
    etcd, run_id, tmp_path, procs
):
    a = _node(etcd, run_id, tmp_path, "a", "run", nnodes="1:3", GLOBAL_BATCH="64")  # alone: world 1 now
    procs.append(a)
    assert a.wait(120) != 0
    assert "global_batch 64 does not split over a world of 3 workers" in a.output(), a.output()[-3000:]
    assert not records(tmp_path, "a")  # not one step trained
