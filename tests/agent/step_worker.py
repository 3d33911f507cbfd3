"""A training-loop stand-in that uses the worker API (run as a script by the agent tests).

Each completed step appends its number to log-<rank>.txt; the final hook writes ckpt-<rank>.json with the
step it is given; at the end exit-<rank>.json says whether the loop was drained.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from elastic_rm.train.report import get_reporter


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--slow-every", type=int, default=0, help="every k-th step takes --slow-ms instead")
    ap.add_argument("--slow-ms", type=float, default=30.0)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--sync-every", type=int, default=0)
    ap.add_argument("--iterate", action="store_true", help="use rep.iterate() instead of rep.step()")
    ap.add_argument(
        "--work", type=int, default=0, help="each step computes this many loop iterations instead of sleeping"
    )
    ap.add_argument("--gloo", action="store_true", help="init a gloo group and all_reduce every step")
    ap.add_argument("--restored", type=int, default=None, help="act as if this global step was restored")
    ap.add_argument(
        "--fail-at", type=int, default=0, help="raise after this many steps (a failed collective)"
    )
    args = ap.parse_args()
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))

    allreduce = None
    if args.gloo:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)

        def allreduce() -> None:
            dist.all_reduce(t)

    if args.restored is not None:  # as FlashCheckpointer's restore does, before the reporter exists
        from elastic_rm.train.report import when_ready
        from elastic_rm.wire.channel import KIND_RESTORED
        from elastic_rm.wire.restore import encode_restored

        body = encode_restored(
            7, args.restored, 2, 1, {"__0_0.distcp": "peer:n1", ".metadata": "local:n0"}, 0.5
        )

        def tell(rep) -> None:
            rep.set_step(args.restored)
            rep.send_after_next_step(KIND_RESTORED, body)

        when_ready(tell)
    rep = get_reporter(sync_every=args.sync_every)

    @rep.on_stop
    def final_checkpoint(step: int) -> None:
        (out / f"ckpt-{rank}.json").write_text(json.dumps({"step": step}))

    log = (out / f"log-{rank}.txt").open("a", buffering=1)

    def body(i: int) -> None:
        slow = args.slow_every and i % args.slow_every == 0
        if args.work:
            x = 0
            for j in range(args.work):
                x += j
        else:
            time.sleep((args.slow_ms if slow else args.step_ms) / 1000.0)
        if allreduce is not None:
            allreduce()
        log.write(f"{i}\n")

    (out / f"ready-{rank}").write_text("")
    if args.iterate:
        for i in rep.iterate(range(1, args.steps + 1), samples=lambda _i: args.samples):
            body(i)
    else:
        for i in range(1, args.steps + 1):
            body(i)
            if rep.step(samples=args.samples):
                break
            if i == args.fail_at:
                raise RuntimeError(f"--fail-at {i}")
    log.close()
    (out / f"exit-{rank}.json").write_text(
        json.dumps({"stopped": rep.should_stop(), "steps": rep.completed_steps, "active": rep.active})
    )
    if args.gloo:
        import gc

        import torch.distributed as dist

        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
