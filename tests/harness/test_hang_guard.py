"""A test its timeout cannot stop ends the session with every thread's stack (tests/hang_guard.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_pytest(tmp_path: Path, source: str, grace_s: int) -> subprocess.CompletedProcess:
    (tmp_path / "pytest.ini").write_text("[pytest]\n")  # not this repository's configuration
    (tmp_path / "test_inner.py").write_text(source)
    argv = [sys.executable, "-m", "pytest", "-p", "tests.hang_guard", "-p", "no:randomly", "-p"]
    argv += ["no:cacheprovider", "--timeout=1", "-o", f"hang_grace={grace_s}", "test_inner.py"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_blocking_the_timeout_signal_ends_the_session_with_its_stacks(tmp_path):
    done = run_pytest(
        tmp_path,
        "import signal, threading, time\n\n"
        "def waiting_helper():\n"
        "    time.sleep(100)\n\n"
        "def test_blocked():\n"
        "    threading.Thread(target=waiting_helper, daemon=True).start()\n"
        "    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
        "    time.sleep(100)\n\n"
        "def test_never_reached():\n"
        "    pass\n",
        grace_s=1,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timeout (0:00:02)!" in done.stderr  # faulthandler: the test's timeout plus the grace
    assert "line 9 in test_blocked" in done.stderr and "line 4 in waiting_helper" in done.stderr
    assert "passed" not in done.stdout


def test_a_test_its_timeout_stops_fails_and_the_session_goes_on(tmp_path):
    done = run_pytest(
        tmp_path,
        "import time\n\ndef test_slow():\n    time.sleep(100)\n\ndef test_next():\n    pass\n",
        grace_s=30,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Timeout (0:00:31)!" not in done.stderr
    assert "Failed: Timeout" in done.stdout and "1 failed, 1 passed" in done.stdout
