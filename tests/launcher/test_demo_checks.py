"""The progress-line checks that the demo, the closed-loop tests and the soak rely on: they must catch a
skipped or repeated batch, and `lineage` must leave out steps lost with a fault. Synthetic progress lines
(B = 10 samples a global batch, 50 samples an epoch), as examples/dlrm/train.py writes them."""

from __future__ import annotations

from elastic_rm.demo.checks import checks, lineage

B, EPOCH = 10, 50


def start(t: float, world: int, restored: int | None) -> dict:
    return {"t": t, "rank": 0, "world": world, "start": True, "restored_step": restored, "checksum": "x",
            "epoch_samples": EPOCH}  # fmt: skip


def steps(t: float, world: int, first: int, last: int, shift: int = 0) -> list[dict]:
    """Steps first..last; step s trains global batch s-1 (+ shift batches: a wrong data position)."""
    out = []
    for s in range(first, last + 1):
        k = s - 1 + shift
        out.append({"t": t + s * 0.01, "rank": 0, "world": world, "step": s, "samples": B // world,
                    "epoch": k * B // EPOCH, "sample_start": k * B % EPOCH, "sample_end": k * B % EPOCH + B})  # fmt: skip
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
