"""One run of the suite for the repeat harness: a fresh clone, its virtualenv, an optional CPU hog, a bound.

The clone is of the repository's committed HEAD (what a new user gets), in a directory of its own that is
removed afterwards; the run's log, its record (record.py) and the files of its failed and slowest tests
(in a short directory of /tmp of their own, named in the run's ``files``) stay. Its virtualenv is either
a fresh ``make setup`` in the clone or a thin venv over an installed one (venv.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_rm.proc import kill_tree

from .record import ENV_RECORD
from .venv import overlay

PLUGIN = "erm_repeat_record"  # record.py under the name it is copied to beside each clone


@dataclass(frozen=True)
class RunSettings:
    repo: Path  # the repository whose HEAD is cloned
    venv: Path | None  # an installed virtualenv the clone's venv builds on; None: `make setup` in the clone
    pytest_args: str  # more arguments for pytest (PYTEST_ARGS of `make test`)
    hog_cpus: int  # `stress-ng --cpu K` beside the run; 0: none
    timeout_s: float  # the run's bound: past it the run is stopped and counted as failed
    keep_clone: bool = False


def clone(repo: Path, into: Path) -> str:
    """A fresh clone of ``repo``'s HEAD; its commit."""
    subprocess.run(
        ["git", "clone", "--quiet", "--no-hardlinks", str(repo), str(into)], check=True, timeout=600
    )
    head = subprocess.run(
        ["git", "-C", str(into), "rev-parse", "HEAD"], capture_output=True, text=True, check=True, timeout=60
    )
    return head.stdout.strip()


def start_hog(cpus: int, seconds: float) -> subprocess.Popen | None:
    """``stress-ng --cpu K``, bounded by its own timeout too; stopped by its pid (:func:`stop`)."""
    if cpus <= 0:
        return None
    argv = ["stress-ng", "--cpu", str(cpus), "--timeout", f"{int(seconds) + 60}s", "--quiet"]
    return subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    kill_tree(proc.pid)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


def pytest_args(settings: RunSettings, seed: int | None, basetemp: Path) -> str:
    """PYTEST_ARGS of the run: the user's, the recording plugin, the tests' files in a directory of the
    run's own (``basetemp``: pytest's own place is shared with every other pytest session and pruned by
    them), and the random order with its seed."""
    args = [settings.pytest_args, f"-p {PLUGIN}", f"--basetemp={basetemp}"]
    if seed is not None:
        args.append(f"-p randomly --randomly-seed={seed}")
    return " ".join(a for a in args if a)


SLOWEST = 25  # the slowest tests each run keeps in the results file
KEEP_FILES = 5  # the slowest tests whose files (their tmp_path) a run keeps, beside every failed test's


def read_record(path: Path) -> tuple[list[dict], dict, str | None, dict[str, float], dict[str, str]]:
    """What record.py wrote: the failures, the session line (counts, exit status; {} when the run ended
    before pytest did), the test that started and did not finish (None when every one finished), the
    seconds each finished test took and where each test wrote its files."""
    failures, session, running, seconds, files = [], {}, None, {}, {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            entry = json.loads(line)
            kind = entry.get("kind")
            if kind == "failure":
                failures.append(entry)
            elif kind == "session":
                session = entry
            elif kind == "tmp":
                files[entry["test"]] = entry["path"]
            elif kind == "start":
                running = entry["test"]
            elif kind == "finish":
                seconds[entry["test"]] = entry.get("seconds", 0.0)
                if running == entry["test"]:
                    running = None
    return failures, session, running, seconds, files


def keep_files(basetemp: Path, files: dict[str, str], keep: list[str]) -> dict[str, str]:
    """Remove every test's files under ``basetemp`` but those of the tests in ``keep`` (a test that
    passed but took far longer than usual leaves its logs to read, as a failed one does); what was kept,
    by test id."""
    kept = {test: files[test] for test in keep if test in files}
    wanted = {Path(path).resolve() for path in kept.values()}
    for entry in basetemp.iterdir() if basetemp.is_dir() else []:
        if entry.resolve() in wanted and not entry.is_symlink():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    return kept


def slowest(seconds: dict[str, float], n: int = SLOWEST) -> list[list]:
    """The ``n`` slowest tests, slowest first, as [test id, seconds]: where the suite's time goes."""
    return [[test, s] for test, s in sorted(seconds.items(), key=lambda item: -item[1])[:n]]


def run_failure(test: str, message: str) -> dict:
    return {"test": test, "when": "run", "message": message, "load_avg": list(os.getloadavg())}


def run_once(index: int, settings: RunSettings, seed: int | None, work: Path) -> dict[str, Any]:
    """Clone, run ``make test`` in the clone (bounded, beside the hog), collect; the run as a JSON object."""
    run_dir = work / f"run-{index:02d}"
    repo, plugin_dir = run_dir / "repo", run_dir / "plugin"
    plugin_dir.mkdir(parents=True)
    shutil.copy(Path(__file__).with_name("record.py"), plugin_dir / f"{PLUGIN}.py")
    commit = clone(settings.repo, repo)
    if settings.venv is not None:
        overlay(settings.venv, repo / ".venv", [repo])
    # short, as pytest's own: tests put Unix sockets under tmp_path, whose paths may not pass 107 bytes
    basetemp = Path(tempfile.mkdtemp(prefix=f"erm-t{index:02d}-", dir="/tmp"))
    make = ["make", "--no-print-directory", "test", f"PYTEST_ARGS={pytest_args(settings, seed, basetemp)}"]
    record, log_path = run_dir / "record.jsonl", run_dir / "pytest.log"
    # the plugin, and nothing inherited: a PYTHONPATH naming another checkout would come before the clone
    env = {**os.environ, "PYTHONPATH": str(plugin_dir), ENV_RECORD: str(record)}
    load_start = list(os.getloadavg())
    date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    hog = start_hog(settings.hog_cpus, settings.timeout_s)
    started = time.monotonic()
    timed_out = False
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                make, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode = proc.wait(settings.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                stop(proc)
                returncode = proc.returncode if proc.returncode is not None else -9
    finally:
        if hog is not None:
            stop(hog)
    wall_s = time.monotonic() - started
    failures, session, running, seconds, files = read_record(record)
    if timed_out:
        message = f"the run did not end within {settings.timeout_s:.0f} s and was stopped"
        failures.append(run_failure(running or "<run timed out>", message))
    elif running is not None:
        message = "the run ended inside this test (the hang guard's stacks, or a crash: see the log)"
        failures.append(run_failure(running, message))
    elif returncode != 0 and not failures:
        message = f"make test exited with {returncode} and no test failed (setup, or a crash: see the log)"
        failures.append(run_failure("<run>", message))
    for failure in failures:
        failure.update(seed=seed, log=str(log_path))
        failure.pop("kind", None)
    if not settings.keep_clone:
        shutil.rmtree(repo, ignore_errors=True)
    slow = [test for test, _ in slowest(seconds, KEEP_FILES)]
    kept = keep_files(basetemp, files, [f["test"] for f in failures] + slow)
    if kept:
        (run_dir / "files").write_text(f"{basetemp}\n")  # where the kept files are
    else:
        shutil.rmtree(basetemp, ignore_errors=True)
    return {
        "index": index,
        "commit": commit,
        "date": date,
        "seed": seed,
        "hog_cpus": settings.hog_cpus,
        "pytest_args": settings.pytest_args,
        "wall_s": round(wall_s, 1),
        "returncode": returncode,
        "timed_out": timed_out,
        "counts": session.get("counts", {}),
        "failures": failures,
        "slowest": slowest(seconds),
        "files": kept,  # test id -> its tmp_path, kept for the failed and the slowest tests
        "load_avg_start": load_start,
        "load_avg_end": list(os.getloadavg()),
        "log": str(log_path),
    }
