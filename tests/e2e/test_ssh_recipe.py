"""examples/ssh_one_machine.sh, the one-machine recipe for `erm launch`: its own sshd on a spare loopback
port, an etcd, an alias-form hostfile of two nodes; the job runs over ssh and ends, and the script stops
what it started (sshd and etcd by their pids, its temporary directory removed)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import REPO

SCRIPT = os.path.join(REPO, "examples", "ssh_one_machine.sh")
HAVE_OPENSSH = all(shutil.which(t) for t in ("ssh", "ssh-keygen")) and bool(
    shutil.which("sshd") or os.path.exists("/usr/sbin/sshd")
)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_OPENSSH, reason="needs OpenSSH (apt-get install openssh-server openssh-client)")
def test_the_recipe_runs_a_job_of_two_nodes_over_ssh_and_cleans_up(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [SCRIPT, "--nodes", "2", "--steps", "60"], capture_output=True, text=True, timeout=300, env=env
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "node n1 exited with 0" in out and "node n2 exited with 0" in out and "job finished" in out, out
    port = re.search(r"n1 addr=127\.0\.0\.1 port=(\d+)", out).group(1)
    assert f"started node n2 on 127.0.0.1:{port}" in out, out
    assert not list(tmp_path.glob("erm-ssh-*"))  # its keys, config and etcd data went with it
    bad = subprocess.run([SCRIPT, "--nodes", "x"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "--nodes must be a positive number" in bad.stderr
