"""Agent side of the local worker channel: step-time aggregation, drain requests and their acks.

The agent makes a private directory (mode 0700) with a Unix datagram socket the workers send to and a
16-byte control file they memory-map to see the drain flag. Workers learn the directory from
``ELASTIC_RM_AGENT_DIR`` (:meth:`AgentChannel.env`). Wire format: :mod:`elastic_rm.wire.channel`.

Step times age out: :meth:`AgentChannel.summary` covers the last ``window_s`` seconds of reports and is
None once no worker reported for that long.
"""

from __future__ import annotations

import logging
import math
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..background import Background
from ..proc import pid_alive
from ..wire.channel import (
    ACK,
    ACK_OK,
    CONTROL,
    CONTROL_NAME,
    ENV_AGENT_DIR,
    HEADER,
    KIND_ACK,
    KIND_BYE,
    KIND_HELLO,
    KIND_STEPS,
    MAGIC,
    ROUND_FILE,
    SOCKET_NAME,
    STEPS,
    VERSION,
    encode_round,
)

log = logging.getLogger(__name__)

DEFAULT_WINDOW_S = 30.0
MAX_KEPT_STEPS = 200_000  # memory bound on the window: ~3.2 MB of step times
_SUN_PATH_MAX = 107  # Linux sockaddr_un.sun_path minus the NUL


@dataclass(frozen=True)
class StepSummary:
    """The node's step times over the window (all its reporting workers pooled)."""

    p50_s: float
    p90_s: float
    busy_p50_s: float  # the median of the steps' busy time (on CPU or waiting for it; see BusyClock)
    samples_per_s: float  # sum over workers of their samples / their step time
    steps: int  # steps in the window, all workers
    age_s: float  # since the newest report
    workers: int  # workers that reported in the window


@dataclass(frozen=True)
class WorkerInfo:
    pid: int
    rank: int  # RANK of the worker (-1 when unset)
    local_rank: int


@dataclass(frozen=True)
class DrainResult:
    """Outcome of :meth:`AgentChannel.wait_for_acks`."""

    acked: dict[int, int]  # pid -> last completed step it saved
    failed: dict[int, int]  # pid -> step, for workers whose final hook raised
    exited: tuple[int, ...]  # expected workers that exited (or said goodbye) without an ack
    missing: tuple[int, ...]  # expected workers still running without an ack at the deadline
    unregistered: tuple[int, ...]  # pids passed in that never used the worker API: nothing to wait for
    elapsed_s: float

    @property
    def complete(self) -> bool:
        return not self.missing


class AgentChannel:
    """Receives worker reports on a background thread. ``start``/``stop``/``close`` (or ``with``)."""

    def __init__(self, directory: str | None = None, window_s: float = DEFAULT_WINDOW_S) -> None:
        if not window_s > 0:
            raise ValueError(f"step-time window must be a positive number of seconds, got {window_s!r}")
        self.window_s = float(window_s)
        self._own_dir = directory is None
        if directory is None:
            directory = tempfile.mkdtemp(prefix="elastic-rm-agent-")
        else:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory = directory
        sock_path = os.path.join(directory, SOCKET_NAME)
        if len(os.fsencode(sock_path)) > _SUN_PATH_MAX:
            raise ValueError(
                f"agent channel socket path {sock_path!r} is longer than {_SUN_PATH_MAX} bytes "
                "(a Unix socket limit); use a shorter directory, e.g. set TMPDIR=/tmp"
            )
        if os.path.exists(sock_path):
            os.unlink(sock_path)  # a stale socket of an agent that died; the directory is ours
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(sock_path)
        self._sock.setblocking(False)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        except OSError:
            pass
        self._control_path = os.path.join(directory, CONTROL_NAME)
        self._drain_seq = 0
        self._write_control(drain=False)
        self._cond = threading.Condition()
        # (mono, pid, wall durations, busy durations, samples)
        self._steps: deque[tuple[float, int, tuple[float, ...], tuple[float, ...], int]] = deque()
        self._kept = 0
        self._last_report: float | None = None
        self._workers: dict[int, WorkerInfo] = {}
        self._acks: dict[int, tuple[int, int]] = {}  # pid -> (step, status)
        self._byes: set[int] = set()
        self._expected: set[int] = set()
        self.steps_total = 0
        self.last_step: tuple[int, float] | None = None  # (global step, unix time) of the newest report
        self.malformed_total = 0
        # kind -> handler(pid, body) of messages other modules define (rounds in place: agent/inplace.py)
        self.extra_handlers: dict[int, Callable[[int, bytes], None]] = {}
        self._receiver = Background(self._run, "elastic-rm-channel")

    # ---- lifecycle -----------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        """Environment to add to every worker's environment."""
        return {ENV_AGENT_DIR: self.directory}

    def start(self) -> AgentChannel:
        self._receiver.start()
        return self

    def stop(self, timeout_s: float = 2.0) -> None:
        self._receiver.stop(timeout_s)

    def close(self) -> None:
        """Stop, close the socket and remove the directory if this channel made it."""
        self.stop()
        self._sock.close()
        if self._own_dir:
            shutil.rmtree(self.directory, ignore_errors=True)
        else:
            for name in (SOCKET_NAME, CONTROL_NAME):
                try:
                    os.unlink(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass

    def __enter__(self) -> AgentChannel:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- messages to workers -------------------------------------------------------------------------
    def send_round(self, pid: int, action: int, round_id: int, env: dict[str, str]) -> None:
        """Tell worker ``pid`` what to do with its next round (``elastic_rm.wire.channel.ROUND_*``); a
        worker that keeps its process across rounds reads it from its own file in the channel's
        directory."""
        path = os.path.join(self.directory, ROUND_FILE.format(pid=pid))
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(encode_round(action, round_id, env))
        os.replace(tmp, path)  # the worker never sees half a message

    # ---- step times ----------------------------------------------------------------------------------
    def summary(self) -> StepSummary | None:
        """p50/p90 step time and samples/s over the window; None when no worker reported within it."""
        now = time.monotonic()
        with self._cond:
            self._trim(now)
            if not self._steps or self._last_report is None:
                return None
            entries = list(self._steps)
            age = now - self._last_report
        durs = sorted(d for _, _, ds, _, _ in entries for d in ds)
        busy = sorted(b for _, _, _, bs, _ in entries for b in bs)
        per_pid: dict[int, list[float]] = {}
        for _, pid, ds, _, samples in entries:
            acc = per_pid.setdefault(pid, [0.0, 0.0])
            acc[0] += samples
            acc[1] += sum(ds)
        # a worker whose steps took (near) no time has no rate: samples / 1e-320 s is inf, which made the
        # record unencodable (JSON has no inf) and stopped this node's metrics
        rates = (s / t for s, t in per_pid.values() if t > 0)
        rate = sum(r for r in rates if math.isfinite(r))
        rate = rate if math.isfinite(rate) else 0.0  # finite rates that overflow together
        return StepSummary(
            p50_s=_quantile(durs, 0.5),
            p90_s=_quantile(durs, 0.9),
            busy_p50_s=_quantile(busy, 0.5),
            samples_per_s=rate,
            steps=len(durs),
            age_s=age,
            workers=len(per_pid),
        )

    def reset_steps(self) -> None:
        """Forget the step times so far (the workers restart into a new round)."""
        with self._cond:
            self._steps.clear()
            self._kept = 0
            self._last_report = None

    def workers(self) -> dict[int, WorkerInfo]:
        """Workers that said hello (use the worker API) and have not said goodbye."""
        with self._cond:
            return dict(self._workers)

    # ---- drain ---------------------------------------------------------------------------------------
    def request_drain(self) -> None:
        """Ask every worker to stop at its next step boundary (after its final hook).

        Acks and goodbyes that arrived before the request are kept (:meth:`clear_drain` forgets them when
        the next round's workers start): a worker whose peers on another node were drained first has
        stopped with them already (``sync_every``'s agreement), and acked before this agent asked."""
        with self._cond:
            self._expected = set(self._workers) | set(self._acks) | self._byes
            self._drain_seq += 1
        self._write_control(drain=True)

    def clear_drain(self) -> None:
        """Lower the drain flag; call before starting the next round's workers."""
        self._write_control(drain=False)
        with self._cond:
            self._acks.clear()
            self._byes.clear()
            self._expected = set()
            for pid in [p for p in self._workers if not pid_alive(p)]:
                del self._workers[pid]

    @property
    def drain_requested(self) -> bool:
        with open(self._control_path, "rb") as f:
            return CONTROL.unpack(f.read(CONTROL.size))[2] != 0

    def wait_for_acks(
        self,
        timeout_s: float,
        pids: Iterable[int] | None = None,
        alive: Callable[[int], bool] = pid_alive,
    ) -> DrainResult:
        """Wait (at most ``timeout_s``) until every expected worker acked, exited or said goodbye.

        Expected: the given ``pids`` that use the worker API, or, without ``pids``, every worker that
        had said hello when :meth:`request_drain` was called. Workers that never used the API are not
        waited for (listed in ``unregistered``): the agent stops them as torchrun would.
        """
        if not timeout_s >= 0:
            raise ValueError(f"drain grace period must be >= 0 seconds, got {timeout_s!r}")
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cond:
            if pids is None:
                expected, unregistered = set(self._expected or self._workers), set()
            else:
                given = {int(p) for p in pids}
                known = set(self._workers) | set(self._acks) | self._byes | self._expected
                expected, unregistered = given & known, given - known
        exited: set[int] = set()
        while True:
            with self._cond:
                pending = expected - set(self._acks) - self._byes - exited
            pending_alive = {p for p in pending if alive(p)}
            exited |= pending - pending_alive
            remaining = deadline - time.monotonic()
            if not pending_alive or remaining <= 0:
                break
            with self._cond:
                self._cond.wait(min(remaining, 0.05))
        with self._cond:
            acks = {p: self._acks[p] for p in expected if p in self._acks}
            byes = {p for p in expected if p in self._byes and p not in acks}
        return DrainResult(
            acked={p: s for p, (s, st) in acks.items() if st == ACK_OK},
            failed={p: s for p, (s, st) in acks.items() if st != ACK_OK},
            exited=tuple(sorted(exited | byes)),
            missing=tuple(sorted(pending_alive)),
            unregistered=tuple(sorted(unregistered)),
            elapsed_s=time.monotonic() - t0,
        )

    # ---- internals -----------------------------------------------------------------------------------
    def _write_control(self, drain: bool) -> None:
        data = CONTROL.pack(MAGIC, VERSION, 1 if drain else 0, self._drain_seq)
        fd = os.open(self._control_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.pwrite(fd, data, 0)  # one 16-byte write at offset 0: workers read it through mmap
        finally:
            os.close(fd)

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._steps and (self._steps[0][0] < horizon or self._kept > MAX_KEPT_STEPS):
            self._kept -= len(self._steps.popleft()[2])

    def _run(self, stopping: threading.Event) -> None:
        while not stopping.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.2)
            except (OSError, ValueError):
                return  # socket closed under us: close() is under way
            if not ready:
                continue
            for _ in range(1024):  # drain what is queued, then look at the stop flag again
                try:
                    data = self._sock.recv(1 << 17)  # > the largest worker datagram (32 KiB)
                except BlockingIOError:
                    break
                except OSError:
                    return
                self.handle_datagram(data)

    def handle_datagram(self, data: bytes) -> None:
        """Parse one worker datagram; malformed ones are counted and dropped, never raised."""
        try:
            magic, version, kind, pid, rank, local_rank = HEADER.unpack_from(data)
            if magic != MAGIC:
                raise ValueError(f"bad magic {magic:#x}")
            if version != VERSION:
                raise ValueError(
                    f"protocol version {version}, this agent speaks {VERSION} (mixed elastic-rm versions?)"
                )
            if pid <= 0:  # kept, it made clear_drain's liveness check raise (psutil refuses pid <= 0)
                raise ValueError(f"pid {pid} is no process id")
            body = memoryview(data)[HEADER.size :]
            if kind == KIND_STEPS:
                completed, samples, n = STEPS.unpack_from(body)
                if n == 0:  # accepted, it made summary() raise on an empty quantile (chaos fuzzing)
                    raise ValueError("steps datagram with no step times")
                if samples < 0:  # accepted, it made samples_per_s negative: the leader rejected the record
                    raise ValueError(f"steps datagram with {samples} samples (must be >= 0)")
                if len(body) != STEPS.size + 16 * n:
                    raise ValueError(f"steps datagram of {len(data)} bytes does not hold {n} step times")
                times = struct.unpack_from(f"<{2 * n}d", body, STEPS.size)
                durs, busy = times[:n], times[n:]
                if not all(0.0 <= t < 1e9 for t in times):  # NaN fails too
                    raise ValueError("step times must be finite, non-negative seconds")
                now = time.monotonic()
                with self._cond:
                    self._steps.append((now, pid, durs, busy, samples))
                    self._kept += n
                    self.steps_total += n
                    self._last_report = now
                    self.last_step = (completed, time.time())
                    self._workers.setdefault(pid, WorkerInfo(pid, rank, local_rank))
                    self._trim(now)
            elif kind == KIND_ACK:
                step, status = ACK.unpack_from(body)
                with self._cond:
                    self._acks[pid] = (step, status)
                    self._cond.notify_all()
            elif kind == KIND_HELLO:  # a new round of this process: what it said in the last one is over
                with self._cond:
                    self._workers[pid] = WorkerInfo(pid, rank, local_rank)
                    self._acks.pop(pid, None)
                    self._byes.discard(pid)
            elif kind == KIND_BYE:
                with self._cond:
                    self._workers.pop(pid, None)
                    self._byes.add(pid)
                    self._cond.notify_all()
            elif kind in self.extra_handlers:
                self.extra_handlers[kind](pid, bytes(body))
            else:
                raise ValueError(f"unknown message kind {kind}")
        except (struct.error, ValueError) as exc:
            self.malformed_total += 1
            if self.malformed_total <= 3:
                log.warning("dropped a malformed worker datagram (%d bytes): %s", len(data), exc)


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolation quantile of an ascending list (numpy's default)."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
