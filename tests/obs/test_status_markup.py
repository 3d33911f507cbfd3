"""`erm status`/`erm top` print event messages and node values as text: "[...]" in them is not rich markup
(a failed node's last output lines, "[rank0]: ...", a path in brackets)."""

from __future__ import annotations

import io

from rich.console import Console

from launcher.commands.status import render

MESSAGE = "node n1 failed: ermrun exited with 1: [rank0]: RuntimeError: boom; logs in [/tmp/logs] [bold]x"


def status_with_event(message: str) -> dict:
    return {
        "closed": None,
        "sealed": True,
        "run": "r",
        "round": 1,
        "world_size": 1,
        "leader": "n1",
        "samples_per_s": None,
        "members": [{"rank": 0, "node": "n1", "state": "[red]active"}],
        "standby": [],
        "decisions": [],
        "events": [{"time": 1.7e9, "node": "n1", "kind": "launch", "message": message}],
        "errors": [],
    }


def test_event_messages_with_brackets_are_printed_as_written():
    out = io.StringIO()
    Console(file=out, width=400).print(render(status_with_event(MESSAGE)))
    shown = out.getvalue()
    assert MESSAGE in shown  # a closing tag that opens nothing raised MarkupError; "[rank0]" vanished
    assert "[red]active" in shown
