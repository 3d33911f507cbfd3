"""Key names of one run in etcd: every key a run uses is named here. The run id cannot escape its prefix."""

from __future__ import annotations

import re
from dataclasses import dataclass

DEFAULT_PREFIX = "/elastic-rm"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_name(what: str, value: str) -> str:
    """Run ids and node ids become key segments: letters, digits, '.', '_' and '-' only."""
    if not _NAME.match(value or "") or value in (".", ".."):
        raise ValueError(
            f"invalid {what} {value!r}: use 1-128 letters, digits, '.', '_' or '-' (no '/', no spaces), "
            "starting with a letter or digit"
        )
    return value


def validate_prefix(prefix: str) -> str:
    parts = prefix.strip("/").split("/")
    if not prefix.startswith("/") or any(not _NAME.match(p) for p in parts):
        raise ValueError(f"invalid etcd key prefix {prefix!r}: use an absolute path such as /elastic-rm")
    return "/" + "/".join(parts)


@dataclass(frozen=True)
class Keyspace:
    prefix: str
    run_id: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix", validate_prefix(self.prefix))
        validate_name("run id", self.run_id)

    @property
    def run(self) -> str:
        return f"{self.prefix}/{self.run_id}/"

    @property
    def nodes(self) -> str:
        return f"{self.run}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    @property
    def metrics(self) -> str:
        return f"{self.run}metrics/"

    def metric(self, node_id: str) -> str:
        return f"{self.metrics}{node_id}"

    def refused(self, node_id: str) -> str:
        """The reports of nodes that found ``node_id``'s checkpoint port refused
        (rendezvous/dead_peers.py)."""
        return f"{self.run}refused/{node_id}/"

    @property
    def leader(self) -> str:
        return f"{self.run}leader"

    @property
    def round(self) -> str:
        return f"{self.run}round"

    @property
    def rounds(self) -> str:
        return f"{self.run}rounds/"

    def acks(self, number: int) -> str:
        return f"{self.rounds}{number:08d}/acks/"

    def ack(self, number: int, node_id: str) -> str:
        return f"{self.acks(number)}{node_id}"

    def record(self, number: int) -> str:
        return f"{self.rounds}{number:08d}/record"

    def outcome(self, number: int) -> str:
        """What round n did: job throughput before and after it, measured and predicted gain (leader)."""
        return f"{self.rounds}{number:08d}/outcome"

    def store(self, number: int) -> str:
        """The agents' torch Store of round n (rank assignment, exit barrier)."""
        return f"{self.run}store/{number:08d}/"

    @property
    def events(self) -> str:
        """The event log: one key per event, ``events/<unix ns:020d>-<node>-<seq:06d>`` (time order)."""
        return f"{self.run}events/"

    @property
    def demand(self) -> str:
        """The leader's wish for the node count (the planner's advice), read by executors (erm launch)."""
        return f"{self.run}demand"

    @property
    def queue(self) -> str:
        """Nodes other jobs wait for on this run's pool (QueueRecord), from its executor, when it knows."""
        return f"{self.run}queue"

    @property
    def ledger(self) -> str:
        """The sample ledger as of the newest committed checkpoint, mirrored by the leader."""
        return f"{self.run}ledger"

    @property
    def closed(self) -> str:
        return f"{self.run}closed"

    def history(self, signature: str) -> str:
        return f"{self.prefix}/history/{validate_name('job signature', signature)}/{self.run_id}"

    def node_of(self, key: str) -> str:
        """The node id at the end of a ``nodes/``, ``metrics/`` or ``acks/`` key."""
        return key.rsplit("/", 1)[-1]
