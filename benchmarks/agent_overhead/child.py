"""Child processes of the agent-overhead benchmark (separate processes, as in production).

    python -m benchmarks.agent_overhead.child agent DIR            # an AgentChannel until stdin closes
    python -m benchmarks.agent_overhead.child reporter STEP_MS SECONDS   # a worker stepping under the agent
    python -m benchmarks.agent_overhead.child allreduce N SYNC_EVERY     # gloo rank, times the drain vote

Each prints one JSON line with what it measured.
"""

from __future__ import annotations

import json
import sys
import time


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def agent(directory: str) -> None:
    from elastic_rm.agent.channel import AgentChannel

    ch = AgentChannel(directory=directory).start()
    print(json.dumps({"ready": True}), flush=True)
    t0 = time.process_time()
    sys.stdin.read()  # the parent closes stdin to stop us
    cpu = time.process_time() - t0
    print(
        json.dumps({"agent_cpu_s": cpu, "steps": ch.steps_total, "malformed": ch.malformed_total}), flush=True
    )
    ch.close()


def reporter(step_ms: float, seconds: float) -> None:
    from elastic_rm.train.report import get_reporter

    rep = get_reporter()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        spin(step_ms / 1000.0)
        rep.step(samples=64)
    rep.close()
    print(json.dumps({"steps": rep.completed_steps, "dropped": rep._dropped}), flush=True)


def allreduce(n: int, sync_every: int) -> None:
    import gc

    import torch.distributed as dist

    from elastic_rm.train.report import StepReporter

    dist.init_process_group("gloo")
    rep = StepReporter(sync_every=sync_every)  # agent dir from the environment (a real agent)
    for _ in range(50):
        rep.step()  # warm up the group and the flag tensor
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        rep.step()
    per_step = (time.perf_counter() - t0) / n
    rep.close()
    print(json.dumps({"rank": dist.get_rank(), "per_step_us": per_step * 1e6}), flush=True)
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    cmd, *rest = sys.argv[1:]
    if cmd == "agent":
        agent(rest[0])
    elif cmd == "reporter":
        reporter(float(rest[0]), float(rest[1]))
    elif cmd == "allreduce":
        allreduce(int(rest[0]), int(rest[1]))
    else:
        raise SystemExit(f"unknown child command {cmd!r}: use agent, reporter or allreduce")
