"""A pytest plugin: a test that its timeout cannot stop still ends the session, with every thread's stack.

pytest-timeout's signal method fails a test that overruns, printing the stacks of its threads, and the run
goes on. But the signal only works when the main thread returns to the interpreter: a test blocked in C
code that retries on EINTR, or with SIGALRM blocked, runs on until CI's own limit, with no stack. So
beside every test's timeout this arms faulthandler (a C thread, which needs no GIL) ``hang_grace``
seconds later: it writes every thread's stack to the terminal's stderr and exits the process.

Loaded by tests/conftest.py; pytest's own ``faulthandler_timeout`` would replace the timer (faulthandler
has one), so when it is set this plugin arms nothing.
"""

from __future__ import annotations

import faulthandler
import os

import pytest

_stderr: dict[str, int] = {}  # a copy of the terminal's stderr: a test's captured stderr is lost on exit


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "hang_grace",
        "seconds after a test's timeout at which a test still running ends the session with its stacks",
        default="60",
    )


def pytest_configure(config: pytest.Config) -> None:
    if "fd" not in _stderr:
        _stderr["fd"] = os.dup(2)


def pytest_timeout_set_timer(item: pytest.Item, settings) -> None:
    if float(item.config.getini("faulthandler_timeout") or 0) > 0:
        return
    grace = float(item.config.getini("hang_grace"))
    faulthandler.dump_traceback_later(settings.timeout + grace, exit=True, file=_stderr["fd"])


def pytest_timeout_cancel_timer(item: pytest.Item) -> None:
    faulthandler.cancel_dump_traceback_later()
