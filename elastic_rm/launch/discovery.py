"""Host discovery: a user's script that prints the hosts available now (Horovod's host-discovery script).

`erm launch --discovery-script CMD` runs CMD through the shell every ``--discovery-interval`` seconds; its
standard output is read in the hostfile format (elastic_rm.launch.hostfile). The launcher diffs each
answer against the last one: new hosts join the free pool, hosts gone are released (their node drained).
A script that fails or hangs at start is an error; later, the launcher keeps the last good answer.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from ..proc import kill_tree
from .hostfile import Host, HostfileError, parse_hosts


class DiscoveryError(RuntimeError):
    """The discovery script failed, hung or printed something that is not a host list."""


def run_discovery(command: str, timeout_s: float) -> list[Host]:
    """Run the script once (bounded by ``timeout_s``; a hung script's whole tree is killed)."""
    try:
        proc = subprocess.Popen(
            ["/bin/sh", "-c", command],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # so that a timeout kills what the script started, too
        )
    except OSError as exc:
        raise DiscoveryError(f"discovery script {command!r} could not be started: {exc}") from None
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        raise DiscoveryError(
            f"discovery script {command!r} did not finish within {timeout_s:g}s (--discovery-timeout); "
            "make it print the host list and exit"
        ) from None
    except BaseException:
        # Ctrl-C or SIGTERM while the script runs: it is in a session of its own (so that a timeout kills
        # its tree), which no terminal signal reaches; without this it would outlive erm launch
        kill_tree(proc.pid)
        raise
    if proc.returncode != 0:
        tail = err.decode(errors="replace").strip()[-500:] or "(no output on stderr)"
        raise DiscoveryError(f"discovery script {command!r} exited with {proc.returncode}: {tail}")
    try:
        return parse_hosts(out.decode(errors="replace"), f"discovery script {command!r} output")
    except HostfileError as exc:
        raise DiscoveryError(str(exc)) from None


@dataclass(frozen=True)
class HostDiff:
    added: tuple[Host, ...]
    removed: tuple[Host, ...]
    changed: tuple[Host, ...]  # same name, other address/port/user/slots/labels: treated as removed + added


def diff_hosts(old: list[Host], new: list[Host]) -> HostDiff:
    before = {h.name: h for h in old}
    after = {h.name: h for h in new}
    changed = tuple(h for n, h in after.items() if n in before and _fingerprint(before[n]) != _fingerprint(h))
    return HostDiff(
        added=tuple(h for n, h in after.items() if n not in before),
        removed=tuple(h for n, h in before.items() if n not in after),
        changed=changed,
    )


def _fingerprint(h: Host) -> tuple:
    return (h.addr, h.port, h.user, h.slots, tuple(sorted(h.labels.items())))
