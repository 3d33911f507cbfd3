"""What rank 0's progress lines say about a run: whether a world size trains (the scenario's waits),
where training paused (segments), and the summary's throughput per world size and downtime per change."""

from __future__ import annotations


def restarted_at(rows: list[dict], world: int, since: float, min_steps: int = 3) -> bool:
    """Rank 0's workers started anew at ``world`` after ``since`` and trained ``min_steps`` steps."""
    starts = [
        r["t"]
        for r in rows
        if r.get("start") and r.get("rank") == 0 and r["world"] == world and r["t"] >= since
    ]
    return bool(starts) and world_reached(rows, world, starts[-1], min_steps)


def world_reached(rows: list[dict], world: int, since: float, min_steps: int = 3) -> bool:
    steps = [r for r in rows if r.get("world") == world and r["t"] >= since and "step" in r]
    return len({r["step"] for r in steps}) >= min_steps


def segments(rank0: list[dict], gap_s: float = 2.0, starts: list[float] = ()) -> list[list[dict]]:
    """Rank 0's step lines split where the world changes, training paused (a restart), or a new round
    started (``starts``: rank 0's start lines; a swap of one node keeps the world and may pause < gap_s)."""
    out: list[list[dict]] = []
    for r in rank0:
        prev = out[-1][-1] if out else None
        new_round = prev is not None and any(prev["t"] < s <= r["t"] for s in starts)
        if prev and r["world"] == prev["world"] and r["t"] - prev["t"] <= gap_s and not new_round:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def summarize(rows: list[dict], rounds: list[dict]) -> dict:
    """Throughput per world size (all ranks' samples over the time spent training at that size),
    downtime per change (rank 0's last step before -> first step after), and the restores."""
    steps = [r for r in rows if "step" in r]
    rank0 = sorted((r for r in steps if r.get("rank") == 0), key=lambda r: r["t"])
    starts = [r["t"] for r in rows if r.get("start") and r.get("rank") == 0]
    segs = segments(rank0, starts=starts)
    busy: dict[int, float] = {}
    samples: dict[int, int] = {}
    for seg in segs:
        world, lo, hi = seg[0]["world"], seg[0]["t"], seg[-1]["t"]
        busy[world] = busy.get(world, 0.0) + (hi - lo)
        samples[world] = samples.get(world, 0) + sum(
            r.get("samples", 0) for r in steps if r["world"] == world and lo < r["t"] <= hi
        )
    throughput = {w: samples[w] / busy[w] for w in sorted(busy) if busy[w] > 0}
    downtime = [
        {"from": a[-1]["world"], "to": b[0]["world"], "seconds": b[0]["t"] - a[-1]["t"]}
        for a, b in zip(segs, segs[1:], strict=False)
    ]
    restores = [r for r in rows if r.get("restored_step") is not None and r.get("rank") == 0]
    return {"throughput": throughput, "downtime": downtime, "rounds": rounds, "restores": restores}
