"""The event log: every round, decision, failure, drain, checkpoint and executor action as one JSON line.

Why: an elastic job changes size by itself; the event log is how it explains itself afterwards. Each
agent (and ``erm launch``) appends its events to a local file (``--event-log``) and to etcd under the run's
``events/`` prefix, where every reader (``erm events``, ``erm report``) finds all nodes' events merged in
time order. The etcd copy is kept compacted: a writer trims the prefix to the newest ``keep`` events now
and then, so a long job does not grow etcd without bound. Writes to etcd are fire-and-forget: the log
must never stall a round or a training step.

One event, as written (one line, keys sorted)::

    {"v":1,"time":1764500000.123,"run":"job1","node":"n0","kind":"round","message":"round 3: 2 node(s)",
     "data":{"round":3,"members":["n0","n1"]}}
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..etcd.client import EtcdClient
from ..etcd.errors import EtcdError
from ..etcd.ops import Op
from ..wire.keyspace import Keyspace
from .coalesced import run_soon, wait_idle

log = logging.getLogger(__name__)

VERSION = 1
KINDS = (
    "round",  # a round was written or completed (leader) or joined (agent)
    "decision",  # the policy decided a round: reason, predicted gain
    "outcome",  # a decided round's measured throughput after it settled, against before and the prediction
    "demand",  # the policy's wanted node count changed
    "leader",  # this node became the leader; the leader holds the first round for running nodes
    "failure",  # a worker group failed, a node was lost
    "drain",  # workers drained at a step boundary before a new round
    "checkpoint",  # a flash checkpoint was saved or persisted
    "restore",  # a new round restored state from a checkpoint
    "node",  # a node joined, left or was re-incarnated
    "launch",  # erm launch started, stopped or blacklisted a host
    "job",  # the job started or finished
    "sample",  # a node's periodic compact resource and throughput sample (for erm report and measured gain)
)
# Periodic kinds, about once a second or ten per node: kept in the log, but out of what a person reads by
# default (ermrun's console, `erm status`' recent events, the report's events table, `erm events`), where
# they would hide the losses and decisions; a flag shows them.
PERIODIC_KINDS = frozenset({"sample", "checkpoint"})
DEFAULT_KEEP = 2000  # events kept in etcd per run
# A writer trims the etcd copy after one in this many of its events, at random: the run's copy stays near
# ``keep`` however many nodes write (with a count per writer, 1,000 nodes each sampling every 10 s would
# pile up 100 events a second for 1,000 s before anyone trimmed).
TRIM_EVERY = 100
MAX_VALUE_BYTES = 16 * 1024  # an event larger than this is clipped (etcd values should stay small)
BACKLOG = 256  # recent events kept in memory, replayed to a file or listener attached late
TRIM_BATCH = 64  # deletes per transaction (etcd's default --max-txn-ops is 128)
# The unix times a reader accepts, from 1970 to the end of year 9999: what time.localtime and strftime
# format on every platform. A time outside (1e300, -1e20) is a malformed value, not a crash of the reader.
MIN_TIME = 0.0
MAX_TIME = 253_402_300_799.0


def sane_time(t: object) -> bool:
    """A number of unix seconds that the readers can format (see MAX_TIME)."""
    return (
        isinstance(t, (int, float)) and not isinstance(t, bool) and MIN_TIME <= t <= MAX_TIME
    )  # NaN compares False


class EventError(ValueError):
    """A line or etcd value that is not an event we wrote; names its source."""


@dataclass(frozen=True)
class Event:
    time: float  # unix seconds
    run: str
    node: str  # who wrote it ("" for a tool such as erm launch without a node)
    kind: str
    message: str
    data: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        body = {
            "v": VERSION,
            "time": self.time,
            "run": self.run,
            "node": self.node,
            "kind": self.kind,
            "message": self.message,
            "data": self.data,
        }
        return json.dumps(body, separators=(",", ":"), sort_keys=True, allow_nan=False)

    @classmethod
    def parse(cls, source: str, raw: bytes | str) -> Event:
        """Strict: a value that is not an event is an :class:`EventError` naming ``source``."""
        try:
            d = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise EventError(f"{source}: not a JSON event ({exc})") from None
        if not isinstance(d, dict):
            raise EventError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("v") != VERSION:
            raise EventError(f"{source}: unsupported event version {d.get('v')!r}")
        t = d.get("time")
        if not sane_time(t):
            raise EventError(
                f"{source}: field 'time' must be a number of unix seconds from 1970 to 9999, got {t!r:.40}"
            )
        for name in ("run", "node", "kind", "message"):
            if not isinstance(d.get(name), str):
                raise EventError(f"{source}: field {name!r} must be a string")
        if d["kind"] not in KINDS:
            raise EventError(f"{source}: unknown event kind {d['kind']!r} (known: {', '.join(KINDS)})")
        data = d.get("data", {})
        if not isinstance(data, dict):
            raise EventError(f"{source}: field 'data' must be a JSON object")
        if d["kind"] == "sample":
            _check_sample(source, data)
        return cls(float(t), d["run"], d["node"], d["kind"], d["message"], data)


def _check_sample(source: str, data: dict[str, Any]) -> None:
    """A sample's ``gpu_util``, when there, is a list of utilisations (null: a GPU that did not say)."""
    utils = data.get("gpu_util")
    if utils is not None and not (
        isinstance(utils, list)
        and all(u is None or (isinstance(u, (int, float)) and not isinstance(u, bool)) for u in utils)
    ):
        raise EventError(
            f"{source}: a sample's field 'gpu_util' must be a list of numbers, got {utils!r:.40}"
        )


def _jsonable(value: Any) -> Any:
    """Tuples become lists; non-finite floats become None (strict JSON); anything else must be JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise TypeError(f"event data must be JSON values, got {type(value).__name__}")


CLIPPED_MESSAGE_CHARS = 2000  # of an event past MAX_VALUE_BYTES: the start of its message
CLIPPED_FIELD_BYTES = 512  # and its data fields up to this size (JSON); larger ones are named in "clipped"


def _clipped(event: Event, size: int) -> Event:
    """``event`` within MAX_VALUE_BYTES: its message's start and its small data fields, with the names
    of the fields left out. Its sizes come from the run (host lists, a failed node's output lines), so an
    event too large is no programming error: refused, it ended erm launch (and stopped its nodes)."""
    message = event.message
    if len(message) > CLIPPED_MESSAGE_CHARS:
        message = message[:CLIPPED_MESSAGE_CHARS] + f"... ({len(event.message)} characters)"
    kept = {k: v for k, v in event.data.items() if len(json.dumps(v)) <= CLIPPED_FIELD_BYTES}
    kept["clipped"] = {"bytes": size, "fields": sorted(set(event.data) - set(kept))}
    if len(Event(event.time, event.run, event.node, event.kind, message, kept).to_json()) > MAX_VALUE_BYTES:
        kept = {"clipped": {"bytes": size, "fields": sorted(event.data)}}  # many small fields
    log.warning("event %r clipped from %d bytes: %s", event.kind, size, message[:80])
    return Event(event.time, event.run, event.node, event.kind, message, kept)


class EventLog:
    """Appends events to a file and/or to etcd. Thread-safe; never raises on an etcd or disk failure
    (logged once per failure kind); an event past MAX_VALUE_BYTES is clipped (``_clipped``); raises
    TypeError/ValueError for a programming error in ``emit``."""

    def __init__(
        self,
        run_id: str,
        node_id: str = "",
        path: str | os.PathLike | None = None,
        client: EtcdClient | None = None,
        keys: Keyspace | None = None,
        keep: int = DEFAULT_KEEP,
    ):
        self.run_id = run_id
        self.node_id = node_id
        self._client, self._keys = client, keys
        self._keep = max(1, keep)
        self._lock = threading.Lock()
        self._seq = itertools.count()
        self._file: IO[str] | None = None
        self._warned: set[str] = set()
        self._backlog: deque[Event] = deque(maxlen=BACKLOG)
        self._listeners: list[Callable[[Event], None]] = []
        self._last_key: str | None = None  # the newest key sent to etcd (flush waits for it)
        if path is not None:
            self.attach_file(path)

    def attach_file(self, path: str | os.PathLike) -> None:
        """Append this log's events to a JSONL file from now on, starting with the recent ones already
        emitted (the handler emits before the agent that knows the file exists). Raises OSError when the
        file cannot be opened, so that a bad ``--event-log`` fails at start."""
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        f = p.open("a", encoding="utf-8", buffering=1)  # line-buffered: tail -f works
        with self._lock:
            if self._file is not None:
                self._file.close()
            self._file = f
            for event in self._backlog:
                f.write(event.to_json() + "\n")

    def add_listener(self, listener: Callable[[Event], None], replay: bool = True) -> None:
        """Call ``listener(event)`` for every event (on the emitting thread: it must be quick); with
        ``replay`` first for the recent ones already emitted. A listener that raises is logged once."""
        with self._lock:
            backlog = list(self._backlog) if replay else []
            self._listeners.append(listener)
        for event in backlog:
            self._notify(listener, event)

    def _notify(self, listener: Callable[[Event], None], event: Event) -> None:
        try:
            listener(event)
        except Exception as exc:  # noqa: BLE001 - a printer must never break the emitter
            self._warn("listener", f"event listener failed: {exc!r}")

    def set_node(self, node_id: str) -> None:
        """The node id is known only once the handler registered (and changes on re-incarnation)."""
        self.node_id = node_id

    def emit(self, kind: str, message: str, **data: Any) -> Event:
        return self.emit_with((), kind, message, **data)

    def emit_with(
        self, puts: Sequence[tuple[str, bytes | str, int | None]], kind: str, message: str, **data: Any
    ) -> Event:
        """:meth:`emit`, the event's etcd write sent in one transaction with ``puts`` (``(key, value,
        lease)``, without waiting): a node's registration as active and its "round" event are one etcd
        request, not two, when 1,000 nodes make them at once. Needs this log's etcd client for ``puts``."""
        if puts and (self._client is None or self._keys is None):
            raise ValueError("emit_with needs an event log with an etcd client")
        if kind not in KINDS:
            raise ValueError(f"unknown event kind {kind!r} (known: {', '.join(KINDS)})")
        event = Event(time.time(), self.run_id, self.node_id, kind, message, _jsonable(data))
        line = event.to_json()
        if len(line) > MAX_VALUE_BYTES:
            event = _clipped(event, len(line))
            line = event.to_json()
        with self._lock:
            seq = next(self._seq)
            self._backlog.append(event)
            listeners = list(self._listeners)
            if self._file is not None:
                try:
                    self._file.write(line + "\n")
                except OSError as exc:
                    self._warn("file", f"event log file write failed: {exc}")
        for listener in listeners:
            self._notify(listener, event)
        if self._client is not None and self._keys is not None:
            key = f"{self._keys.events}{int(event.time * 1e9):020d}-{self.node_id or 'tool'}-{seq:06d}"
            try:
                if puts:
                    self._client.puts_nowait([*puts, (key, line, None)])
                else:
                    self._client.put_nowait(key, line)
                self._last_key = key
                if random.random() < 1.0 / TRIM_EVERY:  # see TRIM_EVERY
                    client, keys, keep = self._client, self._keys, self._keep
                    run_soon((client, keys.events), lambda: trim(client, keys, keep), "erm-events-trim")
            except EtcdError as exc:
                self._warn("etcd", f"event log to etcd failed: {exc}")
        return event

    def _warn(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s (further failures of this kind are not logged)", message)

    def flush(self, timeout_s: float = 2.0) -> bool:
        """Wait (at most ``timeout_s``) until the newest event sent to etcd is there and a trim of the run's
        log running in the background is done: before a process exits or closes its client, so that its
        last event (``job finished``) is not lost. False on timeout."""
        key, client = self._last_key, self._client
        if key is None or client is None:
            return True
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if client.get(key) is not None:
                    assert self._keys is not None
                    return wait_idle((client, self._keys.events), deadline - time.monotonic())
            except EtcdError:
                return False
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def _is_sample(raw: bytes) -> bool:
    try:
        return json.loads(raw).get("kind") == "sample"
    except (ValueError, RecursionError, AttributeError):
        return False  # a malformed value ages out with the other events


def trim(client: EtcdClient, keys: Keyspace, keep: int) -> int:
    """Delete all but the newest ``keep`` samples and the newest ``keep`` other events of the run in etcd;
    returns how many were deleted. Two budgets, so that a long job's periodic samples never push its
    decisions and failures out of etcd."""
    kvs, _ = client.get_prefix(keys.events)  # in key order = time order
    samples = [kv.key for kv in kvs if _is_sample(kv.value)]
    sample_set = set(samples)
    others = [kv.key for kv in kvs if kv.key not in sample_set]
    doomed = sorted(samples[: max(0, len(samples) - keep)] + others[: max(0, len(others) - keep)])
    if not doomed:
        return 0
    if doomed == [kv.key for kv in kvs[: len(doomed)]]:  # the oldest overall: one range delete
        client.txn([], [Op.delete_range(keys.events, kvs[len(doomed)].key)])
    else:
        for i in range(0, len(doomed), TRIM_BATCH):
            client.txn([], [Op.delete(k) for k in doomed[i : i + TRIM_BATCH]])
    return len(doomed)


def read_etcd(client: EtcdClient, keys: Keyspace) -> tuple[list[Event], list[str], int]:
    """All events of the run in etcd in time order, the errors for values that are not events, and the
    revision read at (to follow with a watch from revision + 1)."""
    kvs, revision = client.get_prefix(keys.events)
    events, errors = [], []
    for kv in kvs:
        try:
            events.append(Event.parse(f"etcd key {kv.key}", kv.value))
        except EventError as exc:
            errors.append(str(exc))
    events.sort(key=lambda e: e.time)
    return events, errors, revision


def read_file(path: str | os.PathLike) -> Iterator[Event | EventError]:
    """Events of a JSONL file in file order; a bad line is yielded as an EventError naming file and line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield Event.parse(f"{path}:{number}", line)
            except EventError as exc:
                yield exc


def merge(*streams: Iterable[Event]) -> list[Event]:
    """Events of several sources in time order, without duplicates (the same event from file and etcd)."""
    seen: set[str] = set()
    out = []
    for event in sorted((e for s in streams for e in s), key=lambda e: e.time):
        line = event.to_json()
        if line not in seen:
            seen.add(line)
            out.append(event)
    return out


def follow_etcd(
    client: EtcdClient,
    keys: Keyspace,
    start_revision: int,
    on_event: Callable[[Event], None],
    on_error: Callable[[str], None],
) -> Callable[[], None]:
    """Deliver the run's new events from ``start_revision`` on (an etcd watch, on the client's I/O thread:
    the callbacks must be quick); a value that is not an event goes to ``on_error``. Returns a cancel
    function. Trimmed (deleted) events are ignored."""

    def handle(changes: list) -> None:
        for change in changes:
            if change.kind != "put":
                continue
            try:
                on_event(Event.parse(f"etcd key {change.kv.key}", change.kv.value))
            except EventError as exc:
                on_error(str(exc))

    return client.watch_prefix(keys.events, start_revision, handle, lambda exc: on_error(str(exc)))


EVENT_IDS_BYTES = 6000  # node ids listed in one event at most (an event is at most 16 KiB)


def ids_for_event(**lists: tuple[str, ...]) -> dict:
    """Node id lists for an event: each list as is while it is small, else only its length
    (``members_count``): a round of 1,000 members would not fit an event. ``world`` is always there."""
    out: dict = {"world": len(lists.get("members", ()))}
    for name, ids in lists.items():
        if sum(len(i) + 3 for i in ids) <= EVENT_IDS_BYTES:
            out[name] = ids
        else:
            out[f"{name}_count"] = len(ids)
    return out
