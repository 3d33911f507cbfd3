"""The JSON values the rendezvous keeps in etcd, with strict parsing.

Nothing read from etcd is unpickled or executed. A value that is not what we wrote is a
:class:`RecordError` naming the key and the field, never a crash or a silent default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from ..planner.interface import NodeState
from .metrics import finite
from .node_lists import COMPACT_AT, NodeListError, decode_ids, encode_ids

VERSION = 1
COMPACT_VERSION = 2  # a round record whose long node lists are compressed (node_lists.py)


class RoundPhase(StrEnum):
    """Where a round record stands. One word per idea: a round is *sealed* once every member acked it."""

    FORMING = "forming"  # written by the leader; members are acking
    SEALED = "sealed"  # every member acked; the workers' bootstrap address is in it
    SUSPENDED = "suspended"  # no members: fewer nodes than the job's minimum


class RecordError(RendezvousStateError):
    """A malformed value in etcd."""


def _load(key: str, raw: bytes, versions: tuple[int, ...] = (VERSION,)) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, a huge number, absurd nesting
        raise RecordError(
            f"malformed value in etcd key {key}: not JSON ({exc}); delete or fix the key"
        ) from None
    if not isinstance(data, dict):
        raise RecordError(
            f"malformed value in etcd key {key}: expected a JSON object, got {type(data).__name__}"
        )
    if data.get("v") not in versions:
        raise RecordError(
            f"malformed value in etcd key {key}: unsupported record version {data.get('v')!r} (this "
            f"elastic-rm reads {', '.join(map(str, versions))}): every node of a run must run the same "
            "elastic-rm release"
        )
    return data


def _field(
    key: str, data: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ...
) -> Any:
    if name not in data:
        if default is ...:
            raise RecordError(f"malformed value in etcd key {key}: missing field {name!r}")
        return default
    value = data[name]
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise RecordError(
            f"malformed value in etcd key {key}: field {name!r} must be a number, got {value!r}"
        )
    if not isinstance(value, kind):
        raise RecordError(f"malformed value in etcd key {key}: field {name!r} has the wrong type ({value!r})")
    return value


def _number(key: str, data: dict[str, Any], name: str, default: Any = ...) -> Any:
    """A finite number field as a float (``default`` when absent). json.loads reads NaN, Infinity and
    integers too large for a float: float() of those raised OverflowError past every RecordError
    handler, and a NaN ``time`` never equals itself (a queue record that never goes stale)."""
    value = _field(key, data, name, (int, float), default)
    if name not in data:
        return value  # the default (a missing required field raised above)
    if not finite(value):
        raise RecordError(
            f"malformed value in etcd key {key}: field {name!r} must be a finite number, got "
            f"{str(value)[:40]}; delete or fix the key"
        )
    return float(value)


def _optional_number(key: str, data: dict[str, Any], name: str) -> float | None:
    """An informational number: None when absent, null or not finite (NaN, inf, too large a float)."""
    value = _field(key, data, name, (int, float, type(None)), None)
    if isinstance(value, bool):
        raise RecordError(
            f"malformed value in etcd key {key}: field {name!r} must be a number, got {value!r}"
        )
    return None if value is None or not finite(value) else float(value)


def _count(key: str, data: dict[str, Any], name: str) -> int:
    """A required int field that counts nodes: 0 or more."""
    value = _field(key, data, name, int)
    if value < 0:
        raise RecordError(f"malformed value in etcd key {key}: {name} must be >= 0, got {value}")
    return value


def _str_list(key: str, data: dict[str, Any], name: str) -> tuple[str, ...]:
    if f"{name}_z" in data:  # a long list, compressed (node_lists.py)
        if name in data:
            raise RecordError(f"malformed value in etcd key {key}: both {name!r} and {name + '_z'!r}")
        try:
            items = list(decode_ids(_field(key, data, f"{name}_z", str)))
        except NodeListError as exc:
            raise RecordError(f"malformed value in etcd key {key}: field {name + '_z'!r}: {exc}") from None
    else:
        items = _field(key, data, name, list, [])
    if not all(isinstance(i, str) and i for i in items):
        raise RecordError(f"malformed value in etcd key {key}: field {name!r} must be a list of node ids")
    if len(set(items)) != len(items):
        raise RecordError(f"malformed value in etcd key {key}: field {name!r} repeats a node id")
    return tuple(items)


def _address(key: str, data: dict[str, Any], name: str) -> tuple[str, int] | None:
    value = _field(key, data, name, (dict, type(None)), None)
    if value is None:
        return None
    addr, port = value.get("addr"), value.get("port")
    if not isinstance(addr, str) or not addr or not isinstance(port, int) or not 0 < port < 65536:
        raise RecordError(f"malformed value in etcd key {key}: field {name!r} must be {{addr, port}}")
    return addr, port


def _port(key: str, data: dict[str, Any], name: str) -> int:
    """A TCP port or 0 (none)."""
    port = _field(key, data, name, int, 0)
    if not 0 <= port < 65536:
        raise RecordError(
            f"malformed value in etcd key {key}: field {name!r} must be a port (0-65535), got {port}"
        )
    return port


def _pid(key: str, data: dict[str, Any]) -> int:
    """A process id: > 0 (0 or a negative pid would signal a process group, -1 every process)."""
    pid = _field(key, data, "pid", int)  # a bool is not an int here
    if pid <= 0:
        raise RecordError(
            f"malformed value in etcd key {key}: field 'pid' must be a process id > 0, got {pid}; "
            "delete or fix the key"
        )
    return pid


def dumps(record: Any, **extra: Any) -> bytes:
    """The record as versioned JSON; ``extra`` adds derived fields for readers (never parsed back)."""
    body = {"v": VERSION, **asdict(record), **extra}
    for name in ("master",):
        if name in body and body[name] is not None:
            body[name] = {"addr": body[name][0], "port": body[name][1]}
    return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


@dataclass(frozen=True)
class NodeRecord:
    """``nodes/<node>``, attached to the node's lease."""

    node: str
    host: str
    addr: str
    pid: int
    nproc: int
    state: NodeState
    round: int = 0  # the last round this node joined (0: none yet)
    cpu_count: int = 0
    mem_total_bytes: int = 0
    gpu_count: int = 0  # GPUs the agent's monitor sees (the planner's capacity; 0: cores/16)
    gpu_model: str = ""  # their product name, as NVML says it
    master_port: int = 0  # a free port on addr, for the workers' MASTER_PORT should this node be rank 0
    # the agent's checkpoint server on addr (elastic_rm/checkpoint/server.py) and its bearer token; 0/"": none
    ckpt_port: int = 0
    ckpt_token: str = field(default="", repr=False)
    # its workers keep their processes across rounds (elastic_rm.train.rounds): a node joining the run
    # may start its own workers before the round is sealed (elastic_rm/agent/prepared.py)
    in_place: bool = False

    @classmethod
    def parse(cls, key: str, raw: bytes) -> NodeRecord:
        d = _load(key, raw)
        state = _field(key, d, "state", str)
        if state not in NodeState.__members__.values():
            raise RecordError(
                f"malformed value in etcd key {key}: unknown node state {state!r} "
                f"(one of {', '.join(NodeState)})"
            )
        return cls(
            node=_field(key, d, "node", str),
            host=_field(key, d, "host", str),
            addr=_field(key, d, "addr", str),
            pid=_pid(key, d),
            nproc=_field(key, d, "nproc", int),
            state=NodeState(state),
            round=_field(key, d, "round", int, 0),
            cpu_count=_field(key, d, "cpu_count", int, 0),
            mem_total_bytes=_field(key, d, "mem_total_bytes", int, 0),
            gpu_count=_field(key, d, "gpu_count", int, 0),
            gpu_model=_field(key, d, "gpu_model", str, ""),
            master_port=_field(key, d, "master_port", int, 0),
            ckpt_port=_port(key, d, "ckpt_port"),
            ckpt_token=_field(key, d, "ckpt_token", str, ""),
            in_place=_field(key, d, "in_place", bool, False),
        )


STRAGGLERS = "stragglers"  # the round record's extra field: the members it drops as stragglers


@dataclass(frozen=True)
class RoundRecord:
    """``round``: the current round, written only by the leader in a fenced transaction.

    Written twice: first unsealed (members ack it), then, once every member acked, ``sealed`` with the
    workers' bootstrap address from rank 0's ack; or once, sealed, with rank 0's advertised port when no
    member needs to ack (elastic_rm/rendezvous/seal.py). A round without members suspends the run. Its
    :attr:`phase` names which of these it is.
    """

    round: int
    members: tuple[str, ...]
    standby: tuple[str, ...] = ()
    reason: str = ""
    leader: str = ""
    sealed: bool = False
    predicted_gain: float | None = None
    confidence: float | None = None
    master: tuple[str, int] | None = None  # MASTER_ADDR/MASTER_PORT for the workers
    time: float = 0.0  # unix time of the decision (informational)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def stragglers(self) -> tuple[str, ...]:
        """The old members this round leaves out as stragglers (``extra.stragglers``, the leader's); a
        value that is not a list of node ids counts as none."""
        found = self.extra.get(STRAGGLERS, [])
        ok = isinstance(found, list) and all(isinstance(n, str) for n in found)
        return tuple(found) if ok else ()

    @property
    def phase(self) -> RoundPhase:
        if not self.members:
            return RoundPhase.SUSPENDED
        return RoundPhase.SEALED if self.sealed else RoundPhase.FORMING

    @property
    def took_effect(self) -> bool:
        """Sealed or suspended: the round the run is in, not one still forming."""
        return self.phase is not RoundPhase.FORMING

    @classmethod
    def parse(cls, key: str, raw: bytes) -> RoundRecord:
        d = _load(key, raw, (VERSION, COMPACT_VERSION))
        number = _field(key, d, "round", int)
        if number < 1:
            raise RecordError(f"malformed value in etcd key {key}: round number must be >= 1, got {number}")
        members = _str_list(key, d, "members")
        standby = _str_list(key, d, "standby")
        if set(members) & set(standby):
            raise RecordError(f"malformed value in etcd key {key}: a node is both member and standby")
        # informational: a non-finite one (the leader writes the policy's figure as is) reads as unknown
        # rather than making the round unreadable on every node
        gain, conf = _optional_number(key, d, "predicted_gain"), _optional_number(key, d, "confidence")
        return cls(
            round=number,
            members=members,
            standby=standby,
            reason=_field(key, d, "reason", str, ""),
            leader=_field(key, d, "leader", str, ""),
            sealed=_field(key, d, "sealed", bool, False),
            predicted_gain=gain,
            confidence=conf,
            master=_address(key, d, "master"),
            time=_number(key, d, "time", 0.0),
            extra=_field(key, d, "extra", dict, {}),
        )

    def to_json(self) -> bytes:
        """Versioned JSON; a long member or standby list compressed (version 2: a reader of version 1
        names the version it cannot read, instead of taking a missing list for an empty one)."""
        if max(len(self.members), len(self.standby)) < COMPACT_AT:
            return dumps(self, world_size=self.world_size)
        body = json.loads(dumps(self, world_size=self.world_size))
        body["v"] = COMPACT_VERSION
        for name in ("members", "standby"):
            ids = body[name]
            if len(ids) >= COMPACT_AT:
                body[f"{name}_z"] = encode_ids(ids)
                del body[name]
        return json.dumps(body, separators=(",", ":"), sort_keys=True).encode()


def effective_rounds(kvs, errors: list[str]) -> list[RoundRecord]:
    """The rounds recorded under ``rounds/<n>/record`` among ``kvs`` that took effect (sealed, or empty:
    suspended), in round order. A malformed record is reported in ``errors`` and left out."""
    rounds = {}
    for kv in kvs:
        if "/rounds/" in kv.key and kv.key.endswith("/record"):
            try:
                r = RoundRecord.parse(kv.key, kv.value)
            except RecordError as exc:
                errors.append(str(exc))
                continue
            if r.took_effect:
                rounds[r.round] = r
    return [rounds[n] for n in sorted(rounds)]


@dataclass(frozen=True)
class AckRecord:
    """``rounds/<n>/acks/<node>``: a member is ready for round n. Rank 0 adds the workers' bootstrap
    address."""

    node: str
    master: tuple[str, int] | None = None

    @classmethod
    def parse(cls, key: str, raw: bytes) -> AckRecord:
        d = _load(key, raw)
        return cls(node=_field(key, d, "node", str), master=_address(key, d, "master"))


@dataclass(frozen=True)
class RefusedRecord:
    """``refused/<peer>/<reporter>``, attached to the reporter's lease: the reporter's connects to the peer's
    checkpoint port were refused (rendezvous/dead_peers.py). ``lease``: the peer's lease the reporter saw
    its record under; only reports naming the same lease add up."""

    reporter: str
    lease: int
    time: float = 0.0

    @classmethod
    def parse(cls, key: str, raw: bytes) -> RefusedRecord:
        d = _load(key, raw)
        return cls(
            reporter=_field(key, d, "reporter", str),
            lease=_field(key, d, "lease", int),
            time=_number(key, d, "time", 0.0),
        )


CLOSED_OUTCOMES = ("succeeded", "failed", "stopped")


@dataclass(frozen=True)
class ClosedRecord:
    """``closed``: the job finished; no more rounds. ``outcome``: how, when the closer knew (one of
    CLOSED_OUTCOMES; "" from stock torchrun's launcher, or a record older than the field)."""

    by: str
    time: float = 0.0
    outcome: str = ""

    @classmethod
    def parse(cls, key: str, raw: bytes) -> ClosedRecord:
        d = _load(key, raw)
        outcome = _field(key, d, "outcome", str, "")
        if outcome not in ("", *CLOSED_OUTCOMES):
            raise RecordError(
                f"malformed value in etcd key {key}: field 'outcome' must be one of {CLOSED_OUTCOMES}, got "
                f"{outcome!r}; delete or fix the key"
            )
        return cls(
            by=_field(key, d, "by", str),
            time=_number(key, d, "time", 0.0),
            outcome=outcome,
        )


@dataclass(frozen=True)
class DemandRecord:
    """``demand``: how many nodes the leader's policy wants (the planner's advice), for an executor such as
    ``erm launch`` that can start or release nodes. Written by the leader only when it changes."""

    target_nodes: int  # 0: no opinion
    reason: str = ""
    leader: str = ""
    round: int = 0  # the round current when it was written
    time: float = 0.0

    @classmethod
    def parse(cls, key: str, raw: bytes) -> DemandRecord:
        d = _load(key, raw)
        return cls(
            target_nodes=_count(key, d, "target_nodes"),
            reason=_field(key, d, "reason", str, ""),
            leader=_field(key, d, "leader", str, ""),
            round=_field(key, d, "round", int, 0),
            time=_number(key, d, "time", 0.0),
        )

    def to_json(self) -> bytes:
        return dumps(self)


# The queue's writer rewrites the record at least this often, even when its count is the same; a record
# unchanged for three of its refreshes has lost its writer (a killed `erm launch`): its count is unknown.
QUEUE_WRITE_EVERY_S = 5.0
QUEUE_STALE_AFTER_S = 3 * QUEUE_WRITE_EVERY_S


@dataclass(frozen=True)
class QueueRecord:
    """``queue``: how many nodes other jobs wait for on the pool this run's nodes come from (the cluster's
    queue), written by the executor that places the run's nodes, when it knows. The leader puts it in the
    planner's snapshot (``waiting_nodes``); without the key the planner is told nothing (None).
    ``running_nodes``: the run's own node jobs that the pool runs now; the leader holds the first round
    until that many nodes registered (their agents are still starting), bounded (leader.py)."""

    waiting_nodes: int
    source: str = ""  # who wrote it and what it counts, for people reading etcd
    time: float = 0.0
    running_nodes: int = 0

    @classmethod
    def parse(cls, key: str, raw: bytes) -> QueueRecord:
        d = _load(key, raw)
        running = _field(key, d, "running_nodes", int, 0)
        if running < 0:
            raise RecordError(f"malformed value in etcd key {key}: running_nodes must be >= 0, got {running}")
        return cls(
            waiting_nodes=_count(key, d, "waiting_nodes"),
            source=_field(key, d, "source", str, ""),
            time=_number(key, d, "time", 0.0),
            running_nodes=running,
        )

    def to_json(self) -> bytes:
        return dumps(self)


@dataclass(frozen=True)
class LedgerRecord:
    """``ledger``: the sample ledger as of the newest committed flash checkpoint (the ``ledger`` of its
    manifest's position), mirrored by the leader: one write per checkpoint, never per batch. The
    checkpoint stays the source of truth (its done marks commit with the model state that contains
    them), so this copy is never ahead of the model. ``ledger`` is RangeLedger.checkpoint_state(),
    validated by its reader (RangeLedger.from_checkpoint); the counts are the writer's summary of it."""

    step: int
    node: str
    time: float
    epoch: int
    samples_done: int  # over all epochs
    epoch_samples: int  # samples in one epoch (the ledger's num_samples)
    ledger: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, key: str, raw: bytes) -> LedgerRecord:
        d = _load(key, raw)
        counts = {n: _field(key, d, n, int) for n in ("step", "epoch", "samples_done", "epoch_samples")}
        if any(v < 0 for v in counts.values()):
            raise RecordError(f"malformed value in etcd key {key}: negative count in {counts}")
        return cls(
            node=_field(key, d, "node", str),
            time=_number(key, d, "time"),
            ledger=_field(key, d, "ledger", dict),
            **counts,
        )

    def to_json(self) -> bytes:
        return dumps(self)
