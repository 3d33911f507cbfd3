"""What `erm launch` runs on a host: the same ermrun flags everywhere, plus each node's own id and slots."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from .hostfile import Host
from .ssh import SshOptions, remote_command

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(items: list[str], environ: dict[str, str] | None = None) -> dict[str, str]:
    """``--env NAME`` forwards this launcher's value; ``--env NAME=VALUE`` sets one."""
    environ = dict(os.environ) if environ is None else environ
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not _ENV_NAME.match(name):
            raise ValueError(f"--env {item!r}: use NAME or NAME=VALUE (NAME: letters, digits, _)")
        if not sep:
            if name not in environ:
                raise ValueError(
                    f"--env {name}: not set in this environment; set it or pass --env {name}=VALUE"
                )
            value = environ[name]
        env[name] = value
    return env


@dataclass(frozen=True)
class NodeCommand:
    ssh: SshOptions
    python: str  # the interpreter on the hosts that has elastic-rm installed
    workdir: str  # where ermrun starts on the hosts (the training script's path is relative to it)
    ermrun_flags: tuple[str, ...]  # as the user typed them
    script: tuple[str, ...]  # training script (or module) and its arguments
    env: dict[str, str] = field(default_factory=dict)
    stop_grace_s: float = 30.0

    def ermrun_argv(self, host: Host) -> list[str]:
        """The user's flags, then the node's own: its id (the hostfile name) and, with slots=N, N workers."""
        own = ["--node-id", host.node_id]
        if host.slots is not None:
            own += ["--nproc-per-node", str(host.slots)]
        return [*self.ermrun_flags, *own, *self.script]

    def argv(self, host: Host) -> list[str]:
        env = {**self.env, "ERM_LAUNCH_HOST": host.name, "PYTHONUNBUFFERED": "1"}
        remote = remote_command(self.workdir, env, self.python, self.stop_grace_s, self.ermrun_argv(host))
        return self.ssh.argv(host, remote)
