"""The hostfile: which machines `erm launch` may start nodes on (format in docs/launch.md).

One line is one node (one `ermrun`)::

    # NAME is the node's identity: its --node-id and its log prefix
    gpu01 slots=8 gpu=a100                 # ssh to gpu01; 8 workers there (--nproc-per-node 8)
    gpu02:2222                              # ssh port 2222; node id gpu02-2222
    alice@gpu03                             # ssh user alice; node id gpu03
    n1 addr=10.0.0.7 port=22 user=bob       # alias form: the name differs from the address
    n2 addr=10.0.0.7                        # a second node on the same machine needs its own name

Why the alias form: a node id must be unique in the run, and one machine may carry several nodes (or,
in tests, every "host" is 127.0.0.1). A discovery script prints the same format.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..wire.keyspace import validate_name

FORMAT = "NAME [slots=N] [addr=HOST] [port=N] [user=USER] [label=value ...]"
# host name, IPv4 or IPv6 address; never a leading "-", which ssh would read as one of its options
_ADDR = re.compile(r"^[A-Za-z0-9._:][A-Za-z0-9._:-]*$")
_USER = re.compile(r"^[A-Za-z0-9._][A-Za-z0-9._-]*$")
_LABEL = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]*$")


class HostfileError(ValueError):
    """A hostfile or discovery output that is not in the documented format; names the line."""


@dataclass(frozen=True)
class Host:
    name: str  # identity: node id, log prefix, event log
    addr: str  # what ssh connects to
    port: int | None = None  # ssh port (None: --ssh-port or ssh's default)
    user: str | None = None  # ssh user (None: --ssh-user or ssh's default)
    slots: int | None = None  # worker processes on this node (None: the ermrun flags' --nproc-per-node)
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def node_id(self) -> str:
        return self.name

    def where(self) -> str:
        """user@addr:port as ssh will see it, for messages."""
        user = f"{self.user}@" if self.user else ""
        port = f":{self.port}" if self.port else ""
        return f"{user}{self.addr}{port}"


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"port {text!r} is not a number in 1..65535")
    return int(text)


def parse_line(line: str) -> Host | None:
    """One line; None for a blank line or a comment. Raises ValueError (without the line number)."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    first, *rest = text.split()
    if "=" in first:
        raise ValueError("the line must start with a host name, not key=value")
    user, port = None, None
    if "@" in first:
        user, first = first.split("@", 1)
    name = first
    if first.count(":") == 1:  # host:port (IPv6 addresses go in addr=); the node is named host-port
        first, port_text = first.split(":")
        port = _port(port_text)
        name = f"{first}-{port}"
    addr = first
    slots = None
    labels: dict[str, str] = {}
    for item in rest:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise ValueError(f"{item!r} is not key=value")
        if key == "slots":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"slots={value} must be a whole number >= 1")
            slots = int(value)
        elif key == "addr":
            addr = value
        elif key == "port":
            port = _port(value)
        elif key == "user":
            user = value
        elif _LABEL.match(key):
            labels[key] = value
        else:
            raise ValueError(f"label name {key!r} must start with a letter (letters, digits, _ . -)")
    if not _ADDR.match(addr):
        raise ValueError(f"address {addr!r} is not a host name or IP address")
    if user is not None and not _USER.match(user):
        raise ValueError(f"user {user!r} is not a valid user name")
    validate_name("host name", name)
    return Host(name=name, addr=addr, port=port, user=user, slots=slots, labels=labels)


def parse_hosts(text: str, source: str) -> list[Host]:
    """Every host of a hostfile (or a discovery script's output), in order. ``source`` names it in errors."""
    hosts: list[Host] = []
    seen: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        try:
            host = parse_line(line)
        except ValueError as exc:
            raise HostfileError(
                f"{source}, line {number}: {exc}: {line.strip()!r}; expected {FORMAT}"
            ) from None
        if host is None:
            continue
        if host.name in seen:
            raise HostfileError(
                f"{source}, line {number}: host name {host.name!r} repeats line {seen[host.name]}; give each "
                f"node its own name (alias form: NAME addr=HOST)"
            )
        seen[host.name] = number
        hosts.append(host)
    return hosts


def read_hostfile(path: str) -> list[Host]:
    try:
        # utf-8-sig: a file saved with a byte order mark (Windows editors) read its first name as
        # "\ufeffgpu01", refused as no host name
        with open(path, encoding="utf-8-sig") as fh:
            text = fh.read()
    except OSError as exc:
        raise HostfileError(f"hostfile {path!r} cannot be read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise HostfileError(f"hostfile {path!r} is not UTF-8 text") from None
    hosts = parse_hosts(text, f"hostfile {path}")
    if not hosts:
        raise HostfileError(f"hostfile {path!r} names no host; add one line per node ({FORMAT})")
    return hosts
