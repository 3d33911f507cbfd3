"""The demo's summary from rank 0's progress lines: a downtime per new round, also when the world stays."""

from elastic_rm.demo.summary import summarize


def _steps(world: int, t0: float, n: int, dt: float = 0.1) -> list[dict]:
    return [{"t": t0 + i * dt, "rank": 0, "world": world, "step": i, "samples": 8} for i in range(n)]


def test_a_swap_in_place_shorter_than_the_pause_threshold_gets_its_downtime():
    """A straggler swap keeps the world at 2 and pauses 0.6 s (under the 2 s that marks a restart): its
    round's start line splits the steps, so the summary lists it beside the scale-up's."""
    rows = [{"t": 0.0, "rank": 0, "world": 2, "start": True}, *_steps(2, 0.1, 10)]
    rows += [{"t": 2.5, "rank": 0, "world": 3, "start": True}, *_steps(3, 3.0, 10)]  # scale-up: 2.1 s
    rows += [{"t": 4.3, "rank": 0, "world": 2, "start": True}, *_steps(2, 4.5, 10)]  # swap: 0.6 s
    down = summarize(rows, [])["downtime"]
    assert [(d["from"], d["to"]) for d in down] == [(2, 3), (3, 2)], down
    rows += [{"t": 6.0, "rank": 0, "world": 2, "start": True}, *_steps(2, 6.0, 10)]  # swap, 2 -> 2
    down = summarize(rows, [])["downtime"]
    assert [(d["from"], d["to"]) for d in down] == [(2, 3), (3, 2), (2, 2)], down
    assert abs(down[2]["seconds"] - (6.0 - 5.4)) < 1e-9, down


def test_steps_of_one_round_are_one_segment_and_other_ranks_starts_do_not_split_them():
    rows = [{"t": 0.0, "rank": 0, "world": 2, "start": True}, *_steps(2, 0.1, 20)]
    rows.append({"t": 1.0, "rank": 1, "world": 2, "start": True})  # rank 1's line: not a new round
    s = summarize(rows, [])
    assert s["downtime"] == [] and abs(s["throughput"][2] - 19 * 8 / 1.9) < 1e-6, s
