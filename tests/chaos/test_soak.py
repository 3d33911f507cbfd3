"""A bounded, seeded soak: a 3-node TorchRec DLRM job (examples/dlrm/train.py, paced) with a fault every
minute drawn from the survivable faults of docs/guarantees.md, for 30 minutes. Runs only under
`make test-all` with ERM_SOAK=1 (it takes the time it says). Knobs: ERM_SOAK_MINUTES (30),
ERM_SOAK_FAULT_EVERY (60 s), ERM_SOAK_SEED (1), ERM_SOAK_PACE (steps/s, 5); the figures (faults survived,
rounds, time back to full world per fault, downtime per world change (rank 0's last step before to its
first step after), the world-size schedule, the final state and the reference's)
go to <tmp>/soak.figures.json and $ERM_CHAOS_FIGURES, and the figures docs/guarantees.md quotes to
soak.json in $ERM_SOAK_OUT (default <tmp>; ``python -m benchmarks.soak`` copies it into
benchmarks/results/).

What it checks:
- after every fault the job is back at world 3 (a liveness bound, not a performance assertion);
- the whole history of the round key is consistent (no round lost or doubled);
- at every rank-0 restart: training continued at the step after the restored one and every later step
  ran once; by sample identity, the first global batch after a restore is the one after the restored
  step's (the sample ledger's ranges), and the ledger's count at the end is every step's batch once;
  a planned round restored exactly the drained state (embeddings, optimizer states, dense weights);
- the final state equals, bit for bit, the reference run: the same world-size schedule without faults
  (`replay`). Every sample reached the model once and every restore was exact, or this fails.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from elastic_rm.checkpoint.node_memory import remove_node_memory, run_memory_dir
from elastic_rm.demo.checks import checks, lineage
from elastic_rm.demo.harness import DEFAULT_SCRIPT, Demo
from elastic_rm.demo.summary import summarize, world_reached
from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.server import EtcdServer
from elastic_rm.obs.results_file import write_soak_results
from tests.chaos.helpers import check_round_history, record_figures, round_history, round_record
from tests.ermrun_argv import ermrun_argv, flags

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


def replay(workdir, schedule: list[tuple[int, int, int]]) -> dict:
    """The reference run: the soak's world-size schedule (`lineage`) without faults, one plain ermrun run
    per stretch, each restoring the previous stretch's final checkpoint from a durable directory. Its
    final state must equal the soak's bit for bit: same steps, same samples, same world size for each
    step. (A run at one fixed world size is no reference for a long job: the stretches at world 2 sum
    in another order, and ReLU networks amplify such 1e-9 differences, measured at 1e-3 after 8,000
    steps; see docs/guarantees.md.) Returns rank 0's end line of the last stretch."""
    out = os.path.join(workdir, "replay")
    ckpt = os.path.join(out, "checkpoints")
    end: dict = {}
    for k, (world, first, last) in enumerate(schedule):
        progress = os.path.join(out, f"stretch-{k}")
        script_args = flags(
            steps=last, progress_dir=progress, checkpoint_every=100000, checkpoint_dir=ckpt, persist_every=1
        )
        argv = ermrun_argv(DEFAULT_SCRIPT, *script_args, quiet=True, standalone=True, nproc_per_node=world)
        os.makedirs(progress)
        with open(os.path.join(progress, "log"), "wb") as log:
            proc = subprocess.run(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"}
            )
        assert proc.returncode == 0, f"replay of stretch {k} {world, first, last} failed; log in {progress}"
        rows = [
            json.loads(line)
            for name in os.listdir(progress)
            if name.endswith("-0.jsonl")
            for line in open(os.path.join(progress, name))
        ]
        start = next(r for r in rows if r.get("start"))
        assert (start["restored_step"] or 0) == first - 1, (k, start["restored_step"], first)
        end = next(r for r in rows if r.get("end"))
        assert end["final_step"] == last
    return end


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
        script_args=["--checkpoint-every", "10", "--pace", str(PACE), "--checksum-every", "10"],
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
                back = wait_rows(
                    demo,
                    lambda rows, t=t_end: world_reached(rows, 3, t + 1, 3),
                    300,
                    f"world 3 again after {kind} of {victim}",
                )
                faults.append(
                    {
                        "kind": kind,
                        "victim": victim,
                        "unix": t,
                        "fault_s": t_end - t,
                        "back_at_world_3_s_after_fault_end": back,
                    }
                )
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
    assert final is not None and final["sealed"] and len(final["members"]) == 3
    assert faults  # each one was survived (back at world 3, else wait_rows failed); their count is a figure
    rows = demo.progress()
    ledger = checks(rows)
    assert ledger and all(c["ok"] for c in ledger), [c for c in ledger if not c["ok"]]
    ends = [r for r in rows if r.get("end") and r.get("rank") == 0]
    assert ends, "the job did not end cleanly"
    end = ends[-1]
    schedule = lineage(rows)
    assert schedule and schedule[0][1] == 1 and schedule[-1][2] == end["final_step"], schedule
    reference = replay(tmp_path, schedule)
    figures = {
        "seed": SEED,
        "minutes": MINUTES,
        "pace": PACE,
        "faults_survived": len(faults),
        "faults": faults,
        "rounds": len({r for r, _, _ in history}),
        "final_round": final["round"],
        "final_step": end["final_step"],
        "restarts_checked": sum(
            1 for c in ledger if "as drained" in c["what"] or "restored the last" in c["what"]
        ),
        "ledger_checks": len(ledger),
        "schedule": schedule,
        "downtime_s": [round(d["seconds"], 2) for d in summarize(rows, [])["downtime"]],
        "state": {k: end[k] for k in ("checksum", "checksum_value", "optim_value", "dense_value")},
        "reference_state": {
            k: reference[k] for k in ("checksum", "checksum_value", "optim_value", "dense_value")
        },
    }
    record_figures(tmp_path, "soak", figures)
    write_soak_results(figures, Path(os.environ.get("ERM_SOAK_OUT") or tmp_path))
    # the whole state (embeddings, fused optimizer state, dense weights and optimizer) as the fault-free run
    assert end["checksum"] == reference["checksum"], (end, reference)
