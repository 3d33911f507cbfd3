"""A pytest plugin the repeat harness loads into each run: every failure, the test running, what each test
took and where it wrote its files, the run's counts.

Why a plugin: pytest's terminal summary is for people (its ``-r`` flags decide what it lists); this
records every failed phase with its test id, its message and the load average at that moment, which is
what tells a race under load from a plain bug. Standalone (the standard library and pytest only): the
harness copies it beside the clone it tests, which may be of a commit without it. It writes to the file
named by ``ERM_REPEAT_RECORD`` and does nothing without it.
"""

from __future__ import annotations

import json
import os
import time

import pytest

ENV_RECORD = "ERM_REPEAT_RECORD"


def _write(line: dict) -> None:
    path = os.environ.get(ENV_RECORD)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    """What failed, in one line: the crash pytest's summary names, else the report's first ``E`` line."""
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None and crash.message:
        return crash.message.splitlines()[0][:500]
    lines = [line for line in report.longreprtext.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("E ")]
    return (errors[0] if errors else lines[-1] if lines else "")[:500]


def _failure(test: str, report: pytest.TestReport | pytest.CollectReport, when: str) -> None:
    _write(
        {
            "kind": "failure",
            "test": test,
            "when": when,
            "message": _message(report),
            "load_avg": list(os.getloadavg()),
            "time": time.time(),
        }
    )


_SECONDS: dict[str, float] = {}  # test id -> its setup, call and teardown so far


def pytest_runtest_call(item: pytest.Item) -> None:
    # where the test wrote its files and logs: the harness keeps them for its slowest and failed tests
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if tmp_path is not None:
        _write({"kind": "tmp", "test": item.nodeid, "path": str(tmp_path)})


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    _write({"kind": "start", "test": nodeid})  # a run that ends inside a test (a hang, a crash) names it


def pytest_runtest_logfinish(nodeid: str, location: tuple) -> None:
    # what the test took, its fixtures' setup and teardown included: the harness lists the slowest
    _write({"kind": "finish", "test": nodeid, "seconds": round(_SECONDS.pop(nodeid, 0.0), 3)})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _SECONDS[report.nodeid] = _SECONDS.get(report.nodeid, 0.0) + report.duration
    if report.failed:
        _failure(report.nodeid, report, report.when)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _failure(report.nodeid or "<collection>", report, "collect")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = getattr(reporter, "stats", {})
    counts = {kind: len(reports) for kind, reports in stats.items() if kind and kind != "warnings"}
    _write({"kind": "session", "exit_status": int(exitstatus), "counts": counts})
