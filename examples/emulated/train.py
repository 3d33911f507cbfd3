"""An emulated training job: the elastic API of a real one, with its step time spent in sleep.

What it is: a gloo process group, one all_reduce per step (so every rank agrees on the step and on
stopping), the project's step reporter (the agent measures throughput and drains the workers for a new
round), and a progress file that plays the checkpoint (the next round resumes from it). What it is not:
no model, no data, no GPU. A step takes ``--step-s / speedup(world)`` seconds times a noise factor, spent in
``time.sleep``, so 16 nodes of it fit on 2 cores, and a planner sees the throughput curve you give it.

    ermrun --nnodes 1:8 --job examples/emulated/job.json examples/emulated/train.py \
        --samples 200000 --step-s 0.5 --curve 1:1,2:1.9,4:3.5,8:6 --noise 0.05 --state /shared/job1

It exits 0 when ``--samples`` samples are done. The curve is piecewise linear between its points (world
size: speed-up over one node) and flat past its last point; noise is a uniform factor in [1-n, 1+n].

A slow node, for trying straggler handling: while the file ``--slow-file`` names this node (its node id,
one per line), each of its steps also spins ``--slow-busy-s`` seconds on the CPU. Sleep is not busy time,
spinning is, so the agent's busy-time measure tells that node from the others as it would a real one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist

from elastic_rm.train.report import get_reporter


def parse_curve(text: str) -> list[tuple[int, float]]:
    """``1:1,2:1.9,4:3.5`` -> [(1, 1.0), (2, 1.9), (4, 3.5)]; world sizes increasing, speed-ups > 0."""
    points = []
    for item in text.split(","):
        world, sep, speedup = item.partition(":")
        if not sep or not world.strip().isdigit():
            raise ValueError(f"--curve {text!r}: write WORLD:SPEEDUP pairs, e.g. 1:1,2:1.9,4:3.5")
        points.append((int(world), float(speedup)))
    if [w for w, _ in points] != sorted({w for w, _ in points}) or any(s <= 0 for _, s in points):
        raise ValueError(f"--curve {text!r}: world sizes must increase and speed-ups be > 0")
    return points


def speedup(curve: list[tuple[int, float]], world: int) -> float:
    if world <= curve[0][0]:
        return curve[0][1] * world / curve[0][0]
    for (w0, s0), (w1, s1) in zip(curve, curve[1:], strict=False):
        if world <= w1:
            return s0 + (s1 - s0) * (world - w0) / (w1 - w0)
    return curve[-1][1]


def read_done(path: str) -> int:
    try:
        with open(path) as fh:
            return int(json.load(fh)["samples_done"])
    except FileNotFoundError:
        return 0


def write_done(path: str, done: int) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump({"samples_done": done, "time": time.time()}, fh)
    os.replace(tmp, path)


def is_slow(path: str, node_id: str) -> bool:
    try:
        with open(path) as fh:
            return node_id in fh.read().split()
    except FileNotFoundError:
        return False


def spin(seconds: float) -> None:
    """Busy on the CPU (not asleep) for ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, required=True, help="samples the job trains in all")
    p.add_argument("--global-batch", type=int, default=1024, help="samples per step, over all ranks")
    p.add_argument("--step-s", type=float, default=0.5, help="one node's step time in seconds")
    p.add_argument("--curve", default="1:1,2:1.9,4:3.5,8:6,16:9", help="WORLD:SPEEDUP points")
    p.add_argument("--noise", type=float, default=0.05, help="uniform noise on each step's time (fraction)")
    p.add_argument("--state", required=True, help="directory every node sees: the progress file lives there")
    p.add_argument("--slow-file", help="a file of node ids: while it names this node, its steps also spin")
    p.add_argument("--slow-busy-s", type=float, default=0.2, help="seconds a slow node spins per step")
    args = p.parse_args()
    curve = parse_curve(args.curve)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", world))
    os.makedirs(args.state, exist_ok=True)
    progress = os.path.join(args.state, "progress.json")
    done = torch.tensor([read_done(progress)], dtype=torch.int64)
    dist.broadcast(done, 0)  # every rank resumes from rank 0's reading
    samples_done = int(done.item())
    step_s = args.step_s / speedup(curve, nodes)
    rng = random.Random(f"{os.environ.get('TORCHELASTIC_RUN_ID')}-{rank}-{samples_done}")
    reporter = get_reporter(sync_every=1)
    reporter.reset_timer()
    node_id = os.environ.get("ERM_NODE_ID", "")
    while samples_done < args.samples:
        time.sleep(step_s * rng.uniform(1 - args.noise, 1 + args.noise))
        if args.slow_file and is_slow(args.slow_file, node_id):
            spin(args.slow_busy_s)
        dist.all_reduce(torch.zeros(1))  # the step's collective: every rank finishes it together
        samples_done += args.global_batch
        if rank == 0:
            write_done(progress, samples_done)
        if reporter.step(samples=args.global_batch // world):
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
