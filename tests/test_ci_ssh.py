""".ci/run requires the ssh tests of tests/launch where they can run: a skip there must fail CI, not pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import REPO

BASH = shutil.which("bash") or "/bin/bash"
SSH_TEST = (
    "tests/launch/test_launch_ssh.py::"
    "test_an_unreachable_host_is_reported_blacklisted_and_the_job_runs_on_the_others"
)


def can_run(path_dir: str) -> int:
    """ssh_tests_can_run from .ci/ssh-tests.sh with PATH set to one directory and no fallback sshd."""
    env = {"PATH": path_dir, "SSHD_FALLBACK": os.path.join(path_dir, "no-such-sshd")}
    cmd = [BASH, "-c", ". .ci/ssh-tests.sh && ssh_tests_can_run"]
    return subprocess.run(cmd, cwd=REPO, env=env, timeout=30).returncode


def test_the_ssh_tests_count_as_runnable_only_with_sshd_ssh_and_ssh_keygen(tmp_path):
    for tool in ("sshd", "ssh", "ssh-keygen"):
        exe = tmp_path / tool
        exe.write_text("#!/bin/sh\nexit 0\n")
        exe.chmod(0o755)
    assert can_run(str(tmp_path)) == 0
    for tool in ("sshd", "ssh", "ssh-keygen"):
        hidden = tmp_path / tool
        hidden.rename(tmp_path / f"{tool}.off")
        assert can_run(str(tmp_path)) == 1, f"runnable without {tool}"
        (tmp_path / f"{tool}.off").rename(hidden)


def run_ssh_test(require: bool) -> subprocess.CompletedProcess[str]:
    """One ssh test in a child pytest on a PATH without OpenSSH (only the venv's bin): it cannot run."""
    env = {k: v for k, v in os.environ.items() if k != "ERM_REQUIRE_SSH"}
    env["PATH"] = os.path.dirname(sys.executable)
    if require:
        env["ERM_REQUIRE_SSH"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", SSH_TEST]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # 11 s (a pytest run of its own); CI keeps the check above of what counts as runnable
def test_without_openssh_the_ssh_tests_skip_and_say_why_unless_they_are_required():
    skipped = run_ssh_test(require=False)
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert "1 skipped" in skipped.stdout and "apt-get install" in skipped.stdout, skipped.stdout[-3000:]
    failed = run_ssh_test(require=True)
    assert failed.returncode != 0, failed.stdout[-3000:]
    assert "expected to run the ssh tests" in failed.stdout, failed.stdout[-3000:]
