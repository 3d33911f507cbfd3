"""`erm demo`'s live view and summary print reasons, details, events and the workdir as text: "[...]" in
them is not rich markup (a closing tag that opens nothing raised MarkupError after the whole demo ran)."""

from __future__ import annotations

import io
import types

from rich.console import Console

from launcher.commands import demo

WORKDIR = "/tmp/runs/[/exp]"


def test_summary_prints_brackets_as_written(capsys):
    summary = {
        "rounds": [{"round": 2, "members": ["a"], "reason": "[bold]x", "predicted_gain": 0.1}],
        "throughput": {},
        "downtime": [],
        "restores": [],
        "checks": [{"what": "w", "ok": True, "detail": "[rank0] from [/dev/shm]"}],
        "wall_s": 3.0,
    }
    demo._print_summary(summary, WORKDIR)
    out = capsys.readouterr().out
    assert f"logs and summary.json in {WORKDIR}" in out
    assert "[bold]x" in out and "[rank0] from [/dev/shm]" in out


def test_live_view_prints_event_texts_as_written():
    state = types.SimpleNamespace(nodes={}, events=[{"t": 1.7e9, "text": f"workdir {WORKDIR} [rank0]"}])
    out = io.StringIO()
    Console(file=out, width=200).print(demo._view(state, [], "scale-up"))
    assert f"workdir {WORKDIR} [rank0]" in out.getvalue()
