"""What a worker says when ``with rnd:`` holds its round's failure: one line on the console, the
traceback in the worker's log directory.

Why: after a member's loss every survivor's collective fails, and a full gloo traceback per worker made
a recovery look like a crash on every node's console. The line names the exception and the file; the
file (``held_failures.log`` beside torch's per-worker error file, under ermrun's ``--log-dir``) keeps the
traceback. Without torch's error file (plain torchrun without an agent's log directory) the traceback
stays with the line, as before.
"""

from __future__ import annotations

import logging
import os
import time
import traceback

from .round_memory import forget_new_source_lines

LOG_NAME = "held_failures.log"


def log_path() -> str | None:
    """This worker's held-failure log: beside torch's error file (``TORCHELASTIC_ERROR_FILE``)."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    return os.path.join(os.path.dirname(error_file), LOG_NAME) if error_file else None


def say_held(log: logging.Logger, round_id: int, rank: int, exc: BaseException) -> None:
    """One warning line (the exception's first line); the traceback to this worker's log file."""
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    head = f"elastic-rm: round {round_id} failed on rank {rank} ({type(exc).__name__}: {first})"
    path = log_path()
    with forget_new_source_lines():  # the traceback's source files, cached anew at every loss
        text = "".join(traceback.format_exception(exc))
        if path is not None:
            try:
                with open(path, "a", encoding="utf-8") as fh:
                    fh.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {head}\n{text}\n")
            except OSError:
                path = None
        if path is None:
            log.warning("%s; waiting in place for the next round", head, exc_info=exc)
        else:
            log.warning("%s; waiting in place for the next round (traceback in %s)", head, path)
