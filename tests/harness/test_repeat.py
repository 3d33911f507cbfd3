"""The repeat harness (benchmarks/repeat) on a tiny repository: a failing test is reported with its id,
its seed, the load average and the log; a run that ends inside a test names that test."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.repeat.__main__ import parse_args
from benchmarks.repeat.run import keep_files

REPO = Path(__file__).resolve().parents[2]

MAKEFILE = "BIN := .venv/bin\nPYTEST_ARGS ?=\n\ntest:\n\t$(BIN)/python -m pytest -q -rs $(PYTEST_ARGS)\n"
TESTS = (
    "import os, subprocess, sys\n\n\n"
    "def test_passes():\n    pass\n\n\n"
    "def test_every_process_imports_the_clone():  # with no environment and from elsewhere\n"
    "    argv = [sys.executable, '-c', 'import elastic_rm; print(elastic_rm.__file__)']\n"
    "    out = subprocess.run(argv, env={}, cwd='/', capture_output=True, text=True, check=True)\n"
    "    assert out.stdout.startswith(os.getcwd() + '/elastic_rm/'), out.stdout\n\n\n"
    "def test_fails(tmp_path):\n    (tmp_path / 'node.log').write_text('what it did')\n"
    "    assert 1 == 2, 'deliberately'\n\n\n"
    "def test_also_passes():\n    pass\n"
)

ONE_EACH = ("test_passes", "test_every_process_imports_the_clone", "test_fails", "test_also_passes")
CRASH = "import os, signal\n\n\ndef test_ends_its_session():\n    os.kill(os.getpid(), signal.SIGKILL)\n"


def tiny_repo(path: Path) -> Path:
    path.mkdir()
    (path / "Makefile").write_text(MAKEFILE)
    (path / "pytest.ini").write_text("[pytest]\naddopts = -p no:randomly -p no:cacheprovider\n")
    (path / "test_tiny.py").write_text(TESTS)
    (path / "test_crash.py").write_text(CRASH)
    (path / "elastic_rm").mkdir()
    (path / "elastic_rm" / "__init__.py").write_text("")  # the clone's, not the installed one
    git = ["git", "-C", str(path), "-c", "user.name=t", "-c", "user.email=t@localhost"]
    for args in (
        ["init", "-q"],
        ["add", "Makefile", "pytest.ini", "test_tiny.py", "test_crash.py", "elastic_rm"],
        ["commit", "-q", "-m", "t"],
    ):
        subprocess.run(git + args, check=True, capture_output=True, timeout=60)
    return path


def repeat(repo: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "benchmarks.repeat", "--runs", "1", "--repo", str(repo), "--work-dir"]
    argv += [str(work), "--venv-from", sys.prefix, "--timeout", "120", *args]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)


def test_a_failing_test_is_reported_with_its_id_and_seed(tmp_path):
    repo, work = tiny_repo(tmp_path / "tiny"), tmp_path / "work"
    done = repeat(repo, work, "--seed", "4242", "--pytest-args", "test_tiny.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED test_tiny.py::test_fails (call), seed 4242" in done.stdout
    assert "replay: make test PYTEST_ARGS='test_tiny.py -p randomly --randomly-seed=4242'" in done.stdout
    result = json.loads((work / "repeat.json").read_text())
    assert result["failures_per_test"] == {"test_tiny.py::test_fails": 1}
    assert result["runs_failed"] == 1 and len(result["wall_s"]) == 1
    assert {"commit", "date", "machine", "command"} <= result.keys()
    (run,) = result["runs"]
    assert run["counts"] == {"passed": 3, "failed": 1}
    assert {test for test, _ in run["slowest"]} == {f"test_tiny.py::{name}" for name in ONE_EACH}
    seconds = [s for _, s in run["slowest"]]
    assert seconds == sorted(seconds, reverse=True) and all(s >= 0 for s in seconds)
    (failure,) = run["failures"]
    assert failure["seed"] == 4242 and len(failure["load_avg"]) == 3
    assert "deliberately" in failure["message"]
    log = Path(failure["log"]).read_text()
    assert "--randomly-seed=4242" in log and "1 failed, 3 passed" in log  # run in that order
    assert not (work / "run-01" / "repo").exists()  # the clone is removed, the log kept
    kept = Path(run["files"]["test_tiny.py::test_fails"])  # and the failed test's files
    assert (kept / "node.log").read_text() == "what it did"
    assert len(str(kept)) <= len("/tmp/erm-t01-12345678/") + 30  # room for a Unix socket path below it
    shutil.rmtree(kept.parent)


def test_only_the_files_of_the_tests_named_are_kept(tmp_path):
    base = tmp_path / "base"
    for name in ("test_slow0", "test_quick0", "test_failed0"):
        (base / name).mkdir(parents=True)
        (base / name / "a.log").write_text(name)
    (base / "test_slowcurrent").symlink_to(base / "test_slow0")
    files = {f"t.py::{n[:-1]}": str(base / n) for n in ("test_slow0", "test_quick0", "test_failed0")}
    kept = keep_files(base, files, ["t.py::test_failed", "t.py::test_slow", "t.py::test_gone"])
    assert kept == {
        "t.py::test_failed": str(base / "test_failed0"),
        "t.py::test_slow": str(base / "test_slow0"),
    }
    assert sorted(p.name for p in base.iterdir()) == ["test_failed0", "test_slow0"]
    assert (base / "test_slow0" / "a.log").read_text() == "test_slow0"


def test_a_run_that_ends_inside_a_test_names_that_test(tmp_path):
    repo, work = tiny_repo(tmp_path / "tiny"), tmp_path / "work"
    done = repeat(repo, work, "--pytest-args", "test_crash.py")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED test_crash.py::test_ends_its_session (run), seed None" in done.stdout
    (failure,) = json.loads((work / "repeat.json").read_text())["runs"][0]["failures"]
    assert "the run ended inside this test" in failure["message"]


def test_make_passes_pytest_options_that_start_with_a_dash():
    """``make test-repeat PYTEST_ARGS=--durations=40`` reaches the harness as one value, not as an option
    of its own that argparse refuses."""
    made = ["make", "-s", "-n", "-o", "setup", "test-repeat", "PYTEST_ARGS=--durations=40 -x tests/etcd"]
    line = subprocess.run(made, cwd=REPO, capture_output=True, text=True, timeout=60, check=True).stdout
    argv = shlex.split(line.strip().replace("\\\n", " "))
    start = argv.index("benchmarks.repeat") + 1
    args = parse_args([*argv[start:], "--repo", str(REPO)])
    assert args.pytest_args == "--durations=40 -x tests/etcd"


def test_append_adds_runs_to_the_results_file_and_counts_them_by_condition(tmp_path):
    """Runs spread over days add up in one results file: each run keeps its own commit, date, order and
    hog, and the file counts the runs that passed per condition."""
    repo, results = tiny_repo(tmp_path / "tiny"), tmp_path / "results"
    where = ["--results", "rep", "--results-dir", str(results), "--append"]
    first = repeat(repo, tmp_path / "w1", "--pytest-args", "test_tiny.py -k passes", *where)
    assert first.returncode == 0, first.stdout + first.stderr
    second = repeat(repo, tmp_path / "w2", "--seed", "7", "--pytest-args", "test_tiny.py -k fails", *where)
    assert second.returncode == 1, second.stdout + second.stderr
    body = json.loads((results / "rep.json").read_text())
    assert [run["index"] for run in body["runs"]] == [1, 2]
    assert [run["seed"] for run in body["runs"]] == [None, 7]
    assert all({"commit", "date", "pytest_args"} <= run.keys() for run in body["runs"])
    assert body["runs_total"] == 2 and body["runs_failed"] == 1
    assert body["runs_passed_by_condition"] == {"part-idle-fixed": 1}
    assert body["failures_per_test"] == {"test_tiny.py::test_fails": 1}
    assert "by condition: {'part-idle-fixed': 1}" in second.stdout


def test_append_refuses_a_file_that_is_not_the_harness_results(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "other.json").write_text(json.dumps({"benchmark": "scale", "runs": 3}))
    argv = [sys.executable, "-m", "benchmarks.repeat", "--results", "other", "--append"]
    done = subprocess.run(
        argv + ["--results-dir", str(results), "--repo", str(tiny_repo(tmp_path / "tiny"))],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "not a repeat harness results file" in done.stdout + done.stderr
