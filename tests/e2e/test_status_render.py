"""`erm status` at 1,000 nodes: the member table shows a bounded number of rows and counts the others."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.commands.status import MAX_MEMBERS, render


def status_of(n: int) -> dict:
    members = [{"rank": i, "node": f"node-{i:04d}", "state": "active", "cpu_util": 0.5} for i in range(n)]
    return {
        "closed": None,
        "sealed": True,
        "run": "r",
        "round": 3,
        "world_size": n,
        "leader": "node-0000",
        "samples_per_s": 1000.0,
        "members": members,
        "standby": [],
        "decisions": [],
        "events": [],
        "errors": [],
    }


def text(renderable) -> str:
    out = io.StringIO()
    Console(file=out, width=120).print(renderable)
    return out.getvalue()


def test_many_members_are_counted_not_listed():
    shown = text(render(status_of(1024)))
    assert f"node-{MAX_MEMBERS - 1:04d}" in shown and f"node-{MAX_MEMBERS:04d}" not in shown
    assert f"and {1024 - MAX_MEMBERS} more node(s)" in shown and "world 1024" in shown


def test_members_0_lists_all_and_a_small_job_is_listed_whole():
    assert "node-1023" in text(render(status_of(1024), max_members=0))
    small = text(render(status_of(3)))
    assert "node-0002" in small and "more node(s)" not in small


def test_decision_reasons_are_readable_in_80_columns():
    reason = "1 node(s) joined; scaling to 3 (predicted +40% throughput)"
    s = status_of(3)
    s["decisions"] = [
        {
            "round": r,
            "time": 1.7e9,
            "members": ["a", "b", "c"],
            "reason": reason,
            "predicted_gain": 0.4,
            "measured_gain": 0.3,
            "compared_to_round": r - 1,
            "prediction_error": 0.1,
            "downtime_s": 2.4,
            "redone_steps": 7,
        }
        for r in (2, 3)
    ]
    out = io.StringIO()
    Console(file=out, width=80).print(render(s))
    lines = out.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    for r in (2, 3):  # each reason whole on one line, its figures in the table above
        assert f"round {r}: {reason}" in lines, out.getvalue()
    assert any("+30% (vs r2)" in line and "2.4s" in line for line in lines), out.getvalue()
