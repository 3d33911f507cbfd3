"""The ssh command lines of `erm launch`: OpenSSH's client, never a shell prompt.

The launcher starts each node as ``ssh HOST 'cd WORKDIR && exec env ... PYTHON -m elastic_rm.launch.remote
-- ERMRUN-ARGS'``. Why a supervisor on the host instead of ermrun itself: ssh forwards no signal to the
remote command, but it does forward its standard input and the end of it. The launcher stops a node with
a ``stop`` line (the supervisor sends ermrun SIGTERM, then kills its whole tree after the grace) and keeps
the input open for a later ``kill`` line (the tree killed at once); the end of the input stops it as
``stop`` does, so a launcher that dies (even by SIGKILL) cannot leave agents behind: its ssh clients die
with it.
"""

from __future__ import annotations

import os
import shlex
import shutil
from dataclasses import dataclass

from .hostfile import Host

SSH_EXIT_ERROR = 255  # ssh's own failure (connection refused, login rejected); else the remote status


class SshConfigError(ValueError):
    """The ssh options cannot work (missing key file, no ssh client)."""


@dataclass(frozen=True)
class SshOptions:
    binary: str = "ssh"
    user: str | None = None
    port: int | None = None
    identity: str | None = None
    options: tuple[str, ...] = ()  # extra `-o KEY=VALUE`
    connect_timeout_s: int = 10

    def validate(self) -> None:
        if shutil.which(self.binary) is None:
            raise SshConfigError(
                f"ssh client {self.binary!r} not found: install OpenSSH's client (apt-get install "
                "openssh-client) or pass --ssh-binary PATH"
            )
        if self.identity is not None and not os.path.isfile(self.identity):
            raise SshConfigError(
                f"ssh identity file {self.identity!r} does not exist: pass the private key with "
                "--ssh-identity PATH, or leave it out to use ssh's defaults and agent"
            )
        for opt in self.options:
            if "=" not in opt or opt.startswith("-"):
                raise SshConfigError(f"--ssh-option {opt!r}: use KEY=VALUE, e.g. StrictHostKeyChecking=yes")
        if self.port is not None and not 0 < self.port < 65536:
            raise SshConfigError(f"--ssh-port {self.port}: use a port in 1..65535")

    def argv(self, host: Host, remote_command: str) -> list[str]:
        """ssh's command line for ``remote_command`` on ``host``: no prompt (BatchMode), no pty, and dead
        connections detected within ~15 s (the remote side then stops its agent)."""
        a = [self.binary, "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout_s}"]
        a += ["-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3"]
        if self.identity:
            a += ["-i", self.identity, "-o", "IdentitiesOnly=yes"]
        for opt in self.options:
            a += ["-o", opt]
        port = host.port or self.port
        if port:
            a += ["-p", str(port)]
        user = host.user or self.user
        if user:
            a += ["-l", user]
        return [*a, host.addr, remote_command]


def remote_command(
    workdir: str, env: dict[str, str], python: str, grace_s: float, ermrun_argv: list[str]
) -> str:
    """The shell command that runs one node's agent under the supervisor (elastic_rm.launch.remote)."""
    q = shlex.quote
    assignments = " ".join(f"{k}={q(v)}" for k, v in env.items())
    supervisor = f"{q(python)} -m elastic_rm.launch.remote --grace {grace_s:g} --"
    args = " ".join(q(a) for a in ermrun_argv)
    return f"cd {q(workdir)} && exec env {assignments} {supervisor} {args}"
