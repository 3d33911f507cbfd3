"""What ermrun prints: one line per event (text or JSON) and, on a terminal, a live status line.

Modes (``--log-format text|json``, ``--quiet``): text prints ``[ermrun] HH:MM:SS kind message`` per event
and Python log records at WARNING and above (``LOGLEVEL=INFO`` for the detailed log); json prints every
event and log record as one JSON object per line; quiet prints warnings and errors only. The periodic
"sample" and "checkpoint" events go to the event log, not to the screen. Everything goes to stderr: stdout
is the workers'.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import threading
import time
from typing import IO, TYPE_CHECKING

from elastic_rm.background import Background
from elastic_rm.obs.events import PERIODIC_KINDS, Event

if TYPE_CHECKING:
    from elastic_rm.agent.agent import ElasticRMAgent

STATUS_EVERY_S = 1.0
CLEAR = "\r\x1b[2K"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body = {
            "time": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, sort_keys=True)


class Progress:
    def __init__(self, mode: str = "text", stream: IO[str] | None = None, live: bool | None = None):
        if mode not in ("text", "json", "quiet"):
            raise ValueError(f"unknown output mode {mode!r}")
        self.mode = mode
        self.stream = stream or sys.stderr
        is_tty = getattr(self.stream, "isatty", lambda: False)()
        self.live = (mode == "text" and is_tty) if live is None else live
        self._lock = threading.Lock()
        self._agent: ElasticRMAgent | None = None
        self._line = ""
        self._status = Background(self._status_loop, "ermrun-status")

    def setup_logging(self) -> None:
        """Root logging for ermrun's process: level from $LOGLEVEL (default WARNING), our format."""
        level = os.environ.get("LOGLEVEL", "WARNING").upper()
        handler = logging.StreamHandler(_LineSafeStream(self))
        if self.mode == "json":
            handler.setFormatter(JsonFormatter())
        else:
            handler.setFormatter(logging.Formatter("[ermrun] %(asctime)s %(levelname)s %(message)s"))
        root = logging.getLogger()
        root.handlers[:] = [handler]
        root.setLevel(level if level in logging._nameToLevel else "WARNING")

    def attach(self, agent: ElasticRMAgent) -> None:
        """Called by launch_agent with the agent before it starts."""
        self._agent = agent
        agent.events.add_listener(self.on_event)
        if self.live:
            self._status.start()

    def on_event(self, e: Event) -> None:
        if self.mode == "quiet" or e.kind in PERIODIC_KINDS or e.data.get("console") is False:
            return
        if self.mode == "json":
            self.write_line(e.to_json())
        else:
            stamp = time.strftime("%H:%M:%S", time.localtime(e.time))
            self.write_line(f"[ermrun] {stamp} {e.kind:<8} {e.message}")

    def write_line(self, text: str) -> None:
        """A whole line above the status line (which is redrawn after it)."""
        with self._lock:
            out = (CLEAR if self._line else "") + text.rstrip("\n") + "\n"
            if self._line:
                out += self._line
            self.stream.write(out)
            self.stream.flush()

    def status_line(self) -> str:
        agent = self._agent
        if agent is None:
            return ""
        done = agent.joined_round
        parts = [f"ermrun {agent.node_id}"]
        if done is None:
            parts.append("waiting for a round")
        else:
            rank = done.members.index(agent.node_id) if agent.node_id in done.members else "?"
            parts.append(f"round {done.round} rank {rank}/{len(done.members)}")
        parts.append(agent.worker_state.value.lower())
        record = agent.last_record
        if record is not None:
            steps = record.get("steps")
            if steps:
                parts.append(f"{steps['samples_per_s']:,.0f} samples/s")
                parts.append(f"step {steps['p50_s'] * 1000:.0f} ms")
            parts.append(f"cpu {record['cpu']['util_mean']:.0%}")
            mem = record["mem"]
            parts.append(f"mem {mem['used_bytes'] / 2**30:.1f}/{mem['total_bytes'] / 2**30:.0f} GiB")
        return " | ".join(parts)

    def _status_loop(self, stopping: threading.Event) -> None:
        while not stopping.wait(STATUS_EVERY_S):
            try:
                width = shutil.get_terminal_size((80, 24)).columns
                line = self.status_line()[: max(10, width - 1)]
            except Exception:  # noqa: BLE001 - a status line must never take the agent down
                continue
            with self._lock:
                self._line = line
                self.stream.write(CLEAR + line)
                self.stream.flush()

    def close(self) -> None:
        self._status.stop(timeout_s=2)
        with self._lock:
            if self._line:
                self.stream.write(CLEAR)
                self.stream.flush()
            self._line = ""


class _LineSafeStream:
    """Log records go through Progress.write_line, so that they do not tear the status line."""

    def __init__(self, progress: Progress):
        self._progress = progress

    def write(self, text: str) -> None:
        if text.strip():
            self._progress.write_line(text)

    def flush(self) -> None:
        pass
