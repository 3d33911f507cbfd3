"""The progress-line checks that the demo, the closed-loop tests and the soak rely on: they must catch a
skipped or repeated batch, and `lineage` must leave out steps lost with a fault. Synthetic progress lines
(B = 10 samples a global batch, 50 samples an epoch), as examples/dlrm/train.py writes them."""

from __future__ import annotations

from elastic_rm.demo.checks import checks, drained_checksum, lineage
from elastic_rm.train.state_digest import combined_digest_hex, wrap_int64

B, EPOCH = 10, 50


def start(t: float, world: int, restored: int | None) -> dict:
    return {
        "t": t,
        "rank": 0,
        "world": world,
        "start": True,
        "restored_step": restored,
        "checksum": "x",
        "epoch_samples": EPOCH,
    }


def steps(t: float, world: int, first: int, last: int, shift: int = 0) -> list[dict]:
    """Steps first..last; step s trains global batch s-1 (+ shift batches: a wrong data position)."""
    out = []
    for s in range(first, last + 1):
        k = s - 1 + shift
        out.append(
            {
                "t": t + s * 0.01,
                "rank": 0,
                "world": world,
                "step": s,
                "samples": B // world,
                "epoch": k * B // EPOCH,
                "sample_start": k * B % EPOCH,
                "sample_end": k * B % EPOCH + B,
            }
        )
    return out


def end(t: float, world: int, final: int, done: int) -> dict:
    return {"t": t, "rank": 0, "world": world, "end": True, "final_step": final, "ledger_samples_done": done}


def run(shift: int = 0, done: int = 12 * B) -> list[dict]:
    """World 2 trains steps 1-8 (an epoch boundary at 5), a fault: world 1 restores step 6 and trains 7-12."""
    return [
        start(0, 2, None),
        *steps(0, 2, 1, 8),
        start(10, 1, 6),
        *steps(10, 1, 7, 12, shift),
        end(20, 1, 12, done),
    ]


def test_a_correct_run_passes_every_check_and_its_lineage_leaves_out_the_lost_steps():
    rows = run()
    assert all(c["ok"] for c in checks(rows)), checks(rows)
    assert [c["what"] for c in checks(rows) if "ledger" in c["what"]] == [
        "restart at world 1: every sample once (ledger)",
        "the ledger counts every trained sample once",
    ]
    assert lineage(rows) == [(2, 1, 6), (1, 7, 12)]  # steps 7-8 at world 2 were lost with the fault


def test_a_skipped_or_repeated_batch_and_a_wrong_count_are_caught():
    for shift in (1, -1):  # resumed one batch too far (a skipped batch) or one too early (a repeated one)
        bad = [c for c in checks(run(shift)) if not c["ok"]]
        assert [c["what"] for c in bad] == ["restart at world 1: every sample once (ledger)"], bad
    bad = [c for c in checks(run(done=11 * B)) if not c["ok"]]
    assert [c["what"] for c in bad] == ["the ledger counts every trained sample once"]


PARTS = [[2**62, 5, -7], [2**62, 1, 3]]  # two ranks' digests; the first column wraps past 2**63 - 1
WHOLE = combined_digest_hex(PARTS)


def drains(t: float, step: int, parts: list[list[int]]) -> list[dict]:
    """Each rank's drain line at world len(parts): its part of the drained state's checksum."""
    return [
        {"t": t, "rank": r, "world": len(parts), "drained_step": step, "checksum_part": p}
        for r, p in enumerate(parts)
    ]


def test_the_drained_checksum_adds_every_ranks_part_as_int64_all_reduce_does():
    assert wrap_int64(2**63) == -(2**63) and wrap_int64(-(2**63) - 1) == 2**63 - 1
    assert combined_digest_hex(PARTS) == combined_digest_hex([[-(2**63), 6, -4]])  # the wrapped sums
    rows = drains(9, 8, PARTS)
    assert drained_checksum(rows, 2, 8) == WHOLE
    assert drained_checksum(rows[:1], 2, 8) is None  # a rank's part missing: no checksum
    assert drained_checksum(rows, 2, 7) is None and drained_checksum(rows, 3, 8) is None
    assert drained_checksum(drains(9, 8, [[1, 2, 3], PARTS[1]]), 2, 8) != WHOLE


def test_a_planned_round_must_restore_the_drained_step_not_an_older_checkpoint():
    rows = run()
    rows[9:9] = drains(9, 8, PARTS)  # a drain at step 8 before the restart: a planned round
    bad = [c for c in checks(rows) if not c["ok"]]  # restored step 6: an older state, not the drained one
    assert [c["what"] for c in bad] == ["restart at world 1: state as drained"], bad
    restart = {**start(10, 1, 8), "checksum": WHOLE}
    fixed = [
        start(0, 2, None),
        *steps(0, 2, 1, 8),
        *drains(9, 8, PARTS),
        restart,
        *steps(10, 1, 9, 12),
        end(20, 1, 12, 12 * B),
    ]
    assert all(c["ok"] for c in checks(fixed)), checks(fixed)
    other = [[2**62, 5, -7], [2**62, 1, 4]]  # the right step with another state on rank 1
    wrong = [r for r in fixed if "drained_step" not in r]
    wrong[9:9] = drains(9, 8, other)
    assert [c["what"] for c in checks(wrong) if not c["ok"]] == ["restart at world 1: state as drained"]
    missing = [r for r in fixed if r.get("rank", 0) == 0 or "drained_step" not in r]  # rank 1 never drained
    bad = [c for c in checks(missing) if not c["ok"]]
    assert [c["what"] for c in bad] == ["restart at world 1: state as drained"]
    assert "not every rank reported its part" in bad[0]["detail"]


def test_a_batch_that_starts_the_next_epoch_in_mid_epoch_is_caught():
    rows = run()
    jump = next(r for r in rows if r.get("step") == 8 and r["world"] == 1)
    assert (jump["epoch"], jump["sample_start"]) == (1, 20)  # mid-epoch
    jump.update(epoch=2, sample_start=0, sample_end=B)  # skips the rest of epoch 1
    for r in rows:  # the later batches follow the jump, so only the jump itself is wrong
        if r.get("step", 0) > 8 and r["world"] == 1:
            k = r["step"] - 8
            r.update(epoch=2, sample_start=k * B, sample_end=k * B + B)
    bad = [c for c in checks(rows) if not c["ok"]]
    assert [c["what"] for c in bad] == ["restart at world 1: every sample once (ledger)"], bad
    assert "step 8: samples from 0 (epoch 2), expected 20" in bad[0]["detail"]


def loss_run(restored: int, sources: dict[str, str]) -> list[dict]:
    """Nodes a (rank 0) and b train steps 1-8 with checkpoints committed at 4 and 6; b is lost; a restores
    alone and reads b's file from ``sources['b']``."""
    rows = run()
    rows[0].update(nodes=["a", "b"], saved_by=None, restore_files=None)
    rows.insert(5, {"t": 0.055, "rank": 0, "world": 2, "committed_step": 4})
    rows.insert(8, {"t": 0.075, "rank": 0, "world": 2, "committed_step": 6})
    restart = next(r for r in rows if r.get("start") and r["world"] == 1)
    restart.update(
        restored_step=restored,
        nodes=["a"],
        saved_by=["a", "b"],
        restore_files={"__0_0.distcp": ["a", sources["a"]], "__1_0.distcp": ["b", sources["b"]]},
    )
    return rows


def test_a_restore_after_a_loss_uses_the_newest_committed_step_and_the_lost_nodes_files_from_a_peer():
    good = loss_run(6, {"a": "local:a", "b": "local:a"})  # b's replica, held in a's memory
    assert all(c["ok"] for c in checks(good)), checks(good)
    assert "restart at world 1: the lost node's files from a peer" in [c["what"] for c in checks(good)]
    older = [c["what"] for c in checks(loss_run(4, {"a": "local:a", "b": "local:a"})) if not c["ok"]]
    assert "restart at world 1: restored the last committed checkpoint" in older  # step 6 was committed
    for src in ("durable", "peer:b"):  # the durable copy, or the lost node itself: not a peer's memory
        bad = [c for c in checks(loss_run(6, {"a": "local:a", "b": src})) if not c["ok"]]
        assert [c["what"] for c in bad] == ["restart at world 1: the lost node's files from a peer"], bad
        assert f"__1_0.distcp from {src}" in bad[0]["detail"]
