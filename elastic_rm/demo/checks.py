"""Exactly-once checks on rank 0's progress lines (as examples/dlrm/train.py writes them): at every
restart the restored state, the steps and, by sample identity from the ledger's ranges, the samples that
reached the model; and `lineage`, the world-size schedule the final state holds. The demo, the
closed-loop tests and the soak rely on them; tests/e2e/test_demo_checks.py shows they catch a
skipped or repeated batch."""

from __future__ import annotations

from ..train.state_digest import combined_digest_hex


def checks(rows: list[dict]) -> list[dict]:
    """What the model state went through, checked from rank 0's progress lines at every restart:
    a planned round (a drain before it) restores exactly the drained state (same step; same exact
    checksum of the embeddings, the optimizer states and the dense weights); any other restart restores
    the newest checkpoint committed before the fault, and the files of a node lost with it come from a
    peer's memory (all ranks' start lines say where each file came from); every restart continues at the
    step after the restored one, each step once; and, by sample identity from the ledger's ranges, each
    global batch follows the one before it (a new epoch only where the last one ended), so no sample is
    lost or doubled in the model."""
    rank0 = sorted((r for r in rows if r.get("rank") == 0), key=lambda r: r["t"])
    starts = [i for i, r in enumerate(rank0) if r.get("start")]
    out = []
    for n, i in enumerate(starts[1:], 1):
        start = rank0[i]
        before = rank0[starts[n - 1] : i]
        restored = start.get("restored_step")
        drained = [r for r in before if "drained_step" in r]
        last = max((r["step"] for r in before if "step" in r), default=0)
        nxt = starts[n + 1] if n + 1 < len(starts) else len(rank0)
        after = [r["step"] for r in rank0[i:nxt] if "step" in r]
        label = f"restart at world {start['world']}"
        if drained:  # a planned round: nothing but the drained state will do
            d = drained[-1]
            got = drained_checksum(rows, d["world"], d["drained_step"])
            out.append(
                {
                    "what": f"{label}: state as drained",
                    "ok": d["drained_step"] == restored and got is not None and got == start["checksum"],
                    "detail": f"step {restored}, checksum {start['checksum']} "
                    f"(drained: step {d['drained_step']}, "
                    f"checksum {got or 'missing: not every rank reported its part'})",
                }
            )
        else:
            newest = max((r["committed_step"] for r in before if "committed_step" in r), default=None)
            out.append(
                {
                    "what": f"{label}: restored the last committed checkpoint",
                    "ok": restored is not None
                    and (newest is None or newest <= restored)
                    and restored <= last,
                    "detail": f"step {restored} of {last} trained before the fault "
                    f"(newest committed: {newest}); steps after it are trained again",
                }
            )
            peers = _lost_node_files(rows, start, rank0[nxt]["t"] if nxt < len(rank0) else None)
            if peers is not None:
                out.append({"what": f"{label}: the lost node's files from a peer", **peers})
        consecutive = bool(after) and after == list(
            range((restored or 0) + 1, (restored or 0) + 1 + len(after))
        )
        out.append(
            {
                "what": f"{label}: every step (sample range) once",
                "ok": consecutive,
                "detail": f"steps {after[0] if after else '-'}..{after[-1] if after else '-'} "
                f"follow step {restored}",
            }
        )
        if any("sample_start" in r for r in rank0[i:nxt]):
            out.append(_ledger_check(label, rank0[:i], rank0[i:nxt], restored, start.get("epoch_samples")))
    ends = [r for r in rank0 if r.get("end") and "ledger_samples_done" in r]
    if ends:
        end = ends[-1]
        batch = next((r["samples"] * r["world"] for r in reversed(rank0) if "samples" in r), 0)
        out.append(
            {
                "what": "the ledger counts every trained sample once",
                "ok": end["ledger_samples_done"] == end["final_step"] * batch,
                "detail": f"{end['ledger_samples_done']} samples done = {end['final_step']} steps x {batch}",
            }
        )
    return out


def drained_checksum(rows: list[dict], world: int, step: int) -> str | None:
    """The checksum of the state drained at ``step`` by the world of size ``world``: every rank's drain
    line carries its part (``checksum_part``, the int64 digests of the pieces it holds), added here as
    the collective checksum adds them. None unless each of the world's ranks reported one (the last
    drain line of a rank at that step counts)."""
    parts = {
        r["rank"]: r["checksum_part"]
        for r in sorted(rows, key=lambda r: r["t"])
        if r.get("drained_step") == step and r.get("world") == world and "checksum_part" in r
    }
    if sorted(parts) != list(range(world)):
        return None
    return combined_digest_hex([parts[rank] for rank in range(world)])


def _next_sample(row: dict) -> tuple[int, int]:
    """(epoch, first sample) of the global batch after `row`'s."""
    return row["epoch"], row["sample_end"]


def _lost_node_files(rows: list[dict], start: dict, until: float | None) -> dict | None:
    """After a restart that lost nodes (in the checkpoint's world, not in the new one): every file those
    nodes wrote that a rank of the new world read came from a peer's memory (``local:<survivor>``, a
    replica it holds, or ``peer:<survivor>``), never from the lost node or the durable copy. None when
    no node was lost or the start lines do not say (older scripts)."""
    lost = set(start.get("saved_by") or ()) - set(start.get("nodes") or ())
    if not lost or start.get("restore_files") is None:
        return None
    starts = [
        r
        for r in rows
        if r.get("start")
        and r.get("restore_files") is not None
        and (r["world"], r["restored_step"], r.get("saved_by"))
        == (start["world"], start["restored_step"], start["saved_by"])
        and start["t"] - 60 <= r["t"]
        and (until is None or r["t"] < until)
    ]
    read = {(f, writer, src) for r in starts for f, (writer, src) in r["restore_files"].items()}
    theirs = sorted((f, src) for f, writer, src in read if writer in lost)
    bad = [f"{f} from {src}" for f, src in theirs if src == "durable" or src.split(":", 1)[-1] in lost]
    return {
        "ok": bool(theirs) and not bad,
        "detail": (
            f"{bad[0]}"
            if bad
            else f"{len(theirs)} file(s) of {', '.join(sorted(lost))} from "
            f"{', '.join(sorted({s for _, s in theirs})) or 'nowhere: none read'}"
        ),
    }


def _ledger_check(
    label: str, before: list[dict], after: list[dict], restored: int | None, epoch_samples: int | None
) -> dict:
    """By sample identity, from the ledger's ranges: the first batch after a restore is the one after the
    restored step's batch (a fresh start: sample 0), and each later batch follows the one before; a batch
    starts the next epoch only after the batch that ended the last one."""
    steps = [r for r in after if "sample_start" in r]
    prior = [r for r in before if r.get("step") == restored and "sample_end" in r] if restored else []
    expect = _next_sample(prior[-1]) if prior else (0, 0)
    bad = []
    for r in steps:
        at = (r["epoch"], r["sample_start"])
        epoch_done = epoch_samples is not None and expect[1] >= epoch_samples
        if at != expect and not (epoch_done and at == (expect[0] + 1, 0)):
            bad.append(
                f"step {r['step']}: samples from {r['sample_start']} (epoch {r['epoch']}), "
                f"expected {expect[1]}"
            )
        expect = _next_sample(r)
    first = steps[0]["sample_start"] if steps else "-"
    return {
        "what": f"{label}: every sample once (ledger)",
        "ok": bool(steps) and not bad,
        "detail": bad[0]
        if bad
        else f"samples from {first} follow step {restored}'s batch, none skipped or repeated",
    }


def lineage(rows: list[dict]) -> list[tuple[int, int, int]]:
    """The world-size schedule of the final model: (world, first step, last step) of each stretch of
    steps whose effect the final state holds, oldest first. Steps trained after the checkpoint a restart
    restored from were lost with the fault and are not in it. From rank 0's progress lines."""
    rank0 = sorted((r for r in rows if r.get("rank") == 0), key=lambda r: r["t"])
    starts = [i for i, r in enumerate(rank0) if r.get("start")]
    runs = []  # (world, restored step, last step trained) per worker start
    for n, i in enumerate(starts):
        nxt = starts[n + 1] if n + 1 < len(starts) else len(rank0)
        trained = [r["step"] for r in rank0[i:nxt] if "step" in r]
        restored = rank0[i].get("restored_step") or 0
        runs.append((rank0[i]["world"], restored, max(trained, default=restored)))
    out: list[tuple[int, int, int]] = []
    ends = [r["final_step"] for r in rank0 if r.get("end")]
    upto = ends[-1] if ends else (runs[-1][2] if runs else 0)  # walk back from the final state
    for world, restored, last in reversed(runs):
        if restored < upto <= last:  # this run produced steps restored+1..upto of the lineage
            out.append((world, restored + 1, upto))
            upto = restored
    return out[::-1]
