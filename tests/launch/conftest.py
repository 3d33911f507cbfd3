"""Fixtures of the launch tests: a real sshd (Debian's openssh-server) on loopback."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest

from tests.launch.sshd import SSHD, Sshd

REQUIRE_SSH_ENV = "ERM_REQUIRE_SSH"  # "1": a missing OpenSSH fails the ssh tests instead of skipping them


def ssh_missing(reason: str) -> None:
    """Skip, and say why; fail instead where the caller (.ci/run on a machine that can run them) requires
    the ssh tests, so that a CI run that silently lost them is not green."""
    if os.environ.get(REQUIRE_SSH_ENV) == "1":
        pytest.fail(f"{reason} (${REQUIRE_SSH_ENV}=1: this machine was expected to run the ssh tests)")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory) -> Iterator[Sshd]:
    if not os.path.exists(SSHD):
        ssh_missing(
            "openssh-server is not installed (no sshd): `apt-get install -y openssh-server` "
            "(.ci/run installs it when it runs as root)"
        )
    for tool in ("ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            ssh_missing(f"OpenSSH's {tool} is not installed: `apt-get install -y openssh-client`")
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


@pytest.fixture
def ssh_hosts(sshd, procs) -> Iterator[Sshd]:
    """The session's sshd; after the test, its launchers are stopped first (so that they do not see their
    nodes fail), then whatever still runs through the sshd is killed."""
    yield sshd
    for p in procs:
        p.stop()
    sshd.kill_sessions()
