"""Checks of an output path before the work that writes there: a bad path is an error said at once, not a
traceback after a simulation or a demo ran, or a failed checkpoint save in a background thread."""

from __future__ import annotations

import os


def _nearest_existing(path: str) -> str:
    current = os.path.abspath(path)
    while not os.path.lexists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def output_dir_problem(path: str) -> str | None:
    """Why ``path`` cannot be (or be made) a directory to write in; None when it can."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            return "exists and is not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return "is not writable"
        return None
    base = _nearest_existing(path)
    if not os.path.isdir(base):
        return f"cannot be created: {base} is not a directory"
    if not os.access(base, os.W_OK | os.X_OK):
        return f"cannot be created: {base} is not writable"
    return None


def output_file_problem(path: str) -> str | None:
    """Why a file cannot be written at ``path``; None when it can."""
    if os.path.isdir(path):
        return "is a directory"
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.exists(parent):
        return f"its directory {parent} does not exist"
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    if os.path.exists(path):
        if not os.access(path, os.W_OK):
            return "is not writable"
    elif not os.access(parent, os.W_OK | os.X_OK):
        return f"its directory {parent} is not writable"
    return None
