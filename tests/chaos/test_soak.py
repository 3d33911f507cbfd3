"""A bounded, seeded soak: a 3-node TorchRec DLRM job (examples/dlrm/train.py, paced) with a fault every
minute drawn from the survivable faults of docs/guarantees.md, for 30 minutes. Runs only under
`make test-all` with ERM_SOAK=1 (it takes the time it says). Knobs: ERM_SOAK_MINUTES (30),
ERM_SOAK_FAULT_EVERY (60 s), ERM_SOAK_SEED (1), ERM_SOAK_PACE (steps/s, 5); the figures (faults survived,
rounds, time back to full world per fault, the final model's distance to the reference) go to
<tmp>/soak.figures.json and $ERM_CHAOS_FIGURES.

What it checks:
- after every fault the job is back at world 3 (a liveness bound, not a performance assertion);
- the whole history of the round key is consistent (no round lost or doubled);
- the sample ledger, from every rank-0 restart: training continued at the step after the restored one and
  every later step ran once, so every sample range (step s holds samples [s*B, (s+1)*B)) reached the
  final model exactly once; a planned round restored exactly the drained embeddings;
- the final embeddings equal a plain 3-process run of the same number of steps, up to float reassociation
  (the job ran some steps at world 2 while a node was away).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.train.paths import remove_node_memory, run_memory_dir
from launcher.demo import DEFAULT_SCRIPT, Demo, checks, world_reached
from tests.chaos.helpers import check_round_history, record_figures, round_history, round_record
from tests.conftest import BIN

MINUTES = float(os.environ.get("ERM_SOAK_MINUTES", "30"))
FAULT_EVERY_S = float(os.environ.get("ERM_SOAK_FAULT_EVERY", "60"))
SEED = int(os.environ.get("ERM_SOAK_SEED", "1"))
PACE = float(os.environ.get("ERM_SOAK_PACE", "5"))
LEASE_TTL = 3
FAULTS = ("sigkill_node", "sigstop_node_past_lease", "etcd_down_10s")


def wait_rows(demo: Demo, predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if predicate(demo.progress()):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f}s; logs in {demo.workdir}")


def reference_checksum(workdir, steps: int) -> float:
    out = os.path.join(workdir, "reference")
    argv = [os.path.join(BIN, "ermrun"), "--standalone", "--nproc-per-node", "3", DEFAULT_SCRIPT,
            "--steps", str(steps), "--progress-dir", os.path.join(out, "progress"), "--checkpoint-every", "100000"]  # fmt: skip
    os.makedirs(out)
    with open(os.path.join(out, "log"), "wb") as log:
        proc = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
        )
    assert proc.returncode == 0, f"reference run failed; log in {out}"
    for name in os.listdir(os.path.join(out, "progress")):
        with open(os.path.join(out, "progress", name)) as fh:
            for line in fh:
                row = json.loads(line)
                if row.get("end"):
                    assert row["final_step"] == steps
                    return row["checksum_value"]
    raise AssertionError("the reference run wrote no end line")


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ERM_SOAK") != "1", reason="the soak runs only with ERM_SOAK=1 (make test-all)"
)
@pytest.mark.timeout(int(MINUTES * 60 + 1800))
def test_soak_three_nodes_a_fault_a_minute(tmp_path):
    rng = random.Random(SEED)
    names = ["a", "b", "c"]
    demo = Demo(
        workdir=str(tmp_path),
        script=DEFAULT_SCRIPT,
        script_args=["--checkpoint-every", "10", "--pace", str(PACE)],
        nnodes="2:3",
        lease_ttl=LEASE_TTL,
        agent_args=["--membership-grace", "60"],
    )
    faults: list[dict] = []
    try:
        with EtcdServer(data_dir=str(tmp_path / "etcd-data")) as server:
            for n in names:
                demo.start_node(n, server.endpoint)
            wait_rows(demo, lambda rows: world_reached(rows, 3, 0.0, 5), 240, "3 nodes training")
            end = time.monotonic() + MINUTES * 60
            while time.monotonic() < end:
                time.sleep(max(0.0, min(FAULT_EVERY_S, end - time.monotonic())))
                if time.monotonic() >= end:
                    break
                kind, victim = rng.choice(FAULTS), rng.choice(names)
                t = time.time()
                if kind == "sigkill_node":  # a machine dies, and a new one takes its name
                    demo.nodes[victim].signal(signal.SIGKILL)
                    demo.nodes[victim].stop()
                    remove_node_memory(demo.run_id, victim)  # its memory went with it
                    time.sleep(LEASE_TTL + 3)  # past its lease: the survivors form a round of 2 first
                    demo.start_node(victim, server.endpoint)  # a scale-up round back to 3
                elif kind == "sigstop_node_past_lease":
                    demo.nodes[victim].signal(signal.SIGSTOP)
                    time.sleep(LEASE_TTL + 4)  # replaced, then resumes and rejoins as <id>-r<k>
                    demo.nodes[victim].signal(signal.SIGCONT)
                else:
                    victim = "etcd"
                    server.kill(0)
                    time.sleep(10)
                    server.restart(0)
                t_end = time.time()
                back = wait_rows(demo, lambda rows, t=t_end: world_reached(rows, 3, t + 1, 3), 300,
                                 f"world 3 again after {kind} of {victim}")  # fmt: skip
                faults.append({"kind": kind, "victim": victim, "unix": t, "fault_s": t_end - t,
                               "back_at_world_3_s_after_fault_end": back})  # fmt: skip
            with EtcdClient(server.endpoint) as c:
                history = round_history(c, demo.run_id)
                final = round_record(c, demo.run_id)
            open(os.path.join(demo.progress_dir, "stop"), "w").close()
            for node in demo.nodes.values():
                node.proc.wait(300)
    finally:
        demo.stop_all()
        shutil.rmtree(run_memory_dir(demo.run_id), ignore_errors=True)

    check_round_history(history)
    assert final is not None and final["complete"] and len(final["members"]) == 3
    assert faults  # each one was survived (back at world 3, else wait_rows failed); their count is a figure
    rows = demo.progress()
    ledger = checks(rows)
    assert ledger and all(c["ok"] for c in ledger), [c for c in ledger if not c["ok"]]
    ends = [r for r in rows if r.get("end") and r.get("rank") == 0]
    assert ends, "the job did not end cleanly"
    final_step, value = ends[-1]["final_step"], ends[-1]["checksum_value"]
    expected = reference_checksum(tmp_path, final_step)
    distance = abs(value - expected) / abs(expected)
    record_figures(tmp_path, "soak", {
        "seed": SEED, "minutes": MINUTES, "pace": PACE, "faults_survived": len(faults), "faults": faults,
        "rounds": len({r for r, _, _ in history}), "final_round": final["round"], "final_step": final_step,
        "restarts_checked": len(ledger) // 2, "checksum_rel_distance_to_reference": distance,
    })  # fmt: skip
    assert distance < 1e-4, (value, expected)
