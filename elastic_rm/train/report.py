"""Worker-side step reporting and drain handling for training scripts (one call per step).

Under ``ermrun`` the agent passes a directory in ``ELASTIC_RM_AGENT_DIR``; the worker sends its step times
over a Unix datagram socket there (batched: one datagram per 0.25 s or 1024 steps, never blocking the step)
and reads the agent's drain flag from a 16-byte memory-mapped control file at the same moments. Without the
variable (plain ``torchrun``) every call is a cheap no-op and the script behaves exactly as under torchrun.

Typical use (``step``: the global step, counted on from the restored checkpoint's)::

    rep = get_reporter(sync_every=50)          # sync_every: see "multi-rank" below
    rep.on_stop(lambda step: save_checkpoint(step))
    for batch in rep.iterate(loader, samples=len):
        train_step(batch)
    if rep.should_stop():
        return                                  # drained: the agent restarts us in the next round

Multi-rank jobs must stop every rank at the same step. With ``sync_every=N`` the ranks agree every N steps
with one all_reduce(MAX) of a one-element tensor (0.5-1.3 ms on gloo over loopback on a 2-core machine; on
NCCL it also synchronises the stream once per N steps), so pick N to make that a small share of N steps.
Without it (``sync_every=0``) a multi-rank worker never stops on its own, since stopping alone would hang
its peers: the agent terminates it after the grace period, as torchrun would. Every rank must use the same
``sync_every`` and call :meth:`StepReporter.step` once per step.

Wire format (struct-packed, little endian, no pickle): :mod:`elastic_rm.wire.channel` (agent side:
:mod:`elastic_rm.agent.channel`); a restore report: :mod:`elastic_rm.wire.restore`, sent after the next step
for every restore the flash checkpoint makes in this process (it listens through
:mod:`elastic_rm.checkpoint.restore_report`).
"""

from __future__ import annotations

import atexit
import logging
import mmap
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from ..checkpoint.restore_report import listen_for_restores
from ..wire.channel import (
    ACK,
    ACK_HOOK_FAILED,
    ACK_OK,
    CONTROL,
    CONTROL_NAME,
    ENV_AGENT_DIR,
    ENV_ROUND,
    HEADER,
    KIND_ACK,
    KIND_BYE,
    KIND_HELLO,
    KIND_RESTORED,
    KIND_STEPS,
    MAGIC,
    SOCKET_NAME,
    STEPS,
    VERSION,
)
from ..wire.restore import encode_restored
from .busy_clock import BusyClock
from .worker_env import env_int as _env_int
from .worker_env import world_size as _world_size

if TYPE_CHECKING:
    from ..checkpoint.restore import RestoreResult

MAX_BATCH = 1024  # steps that trigger a send before the interval is up (fast steps)
MAX_PENDING = 4096  # steps kept while the agent is not reading (32 KiB); beyond, the oldest are dropped
FLUSH_INTERVAL_S = 0.25
RELIABLE_WAIT_S = 1.0  # how long hello/ack/goodbye retry a full agent queue (never on the step path)

log = logging.getLogger(__name__)

T = TypeVar("T")


class StepReporter:
    """Records step times, forwards them to the local agent, and stops the loop when the agent drains.

    ``step(samples)`` marks the end of one training step (the time since the previous call is its
    duration) and returns True when the script must stop now; by then the final hook registered with
    :meth:`on_stop` has run and the agent has its acknowledgement. ``samples`` is what *this rank*
    processed in the step (its local batch), so the node's samples/s is the sum over its workers.
    """

    def __init__(
        self,
        agent_dir: str | None = None,
        *,
        sync_every: int = 0,
        group: Any = None,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        if not isinstance(sync_every, int) or sync_every < 0:
            raise ValueError(
                f"sync_every must be an int >= 0 (0 = no cross-rank agreement), got {sync_every!r}"
            )
        if agent_dir is None:
            agent_dir = os.environ.get(ENV_AGENT_DIR) or None
        self.agent_dir = agent_dir
        self.sync_every = sync_every
        self._group = group
        self._flush_interval = flush_interval_s
        self._steps, self._base = 0, 0  # steps in this round (sync_every counts these); global step before it
        self._after_step_msg: bytes | None = None  # the restore report, sent after the next step
        self._stopping = False
        self._hook: Callable[[int], None] | None = None
        self._sock: socket.socket | None = None
        self._mm: mmap.mmap | None = None
        self._durs: list[float] = []
        self._busy: list[float] = []
        self._clock = BusyClock()
        self._last_busy: float | None = None
        self._samples = 0
        self._dropped = 0
        self._last = self._flushed = self._reconnect_at = time.perf_counter()
        # (global step, perf_counter at its end) of this process's newest step: newest_step()
        self._newest: tuple[int, float] | None = None
        self._flag: Any = None  # the all_reduce tensor, made on first use
        self._warned_unsynced = False
        self._warned_unreachable = False
        self._multi = False
        self._drain = False
        self._closed = False
        self._pid = os.getpid()
        self._after_first_step: Callable[[], None] | None = None  # once, after the next step (rounds)
        self._rank = _env_int("RANK")
        self._local_rank = _env_int("LOCAL_RANK")
        if agent_dir is None:
            return
        self._last_busy = self._clock.read()
        self._connect()
        try:
            fd = os.open(os.path.join(agent_dir, CONTROL_NAME), os.O_RDONLY)
            try:
                self._mm = mmap.mmap(fd, CONTROL.size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        except OSError as exc:
            log.warning(
                "elastic-rm: cannot read the agent's control file in %s (%s); drain disabled", agent_dir, exc
            )
        self._send(self._header(KIND_HELLO), wait_s=0.2)

    # ---- public API ----------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """True under an elastic-rm agent; False under plain torchrun (every call is then a no-op)."""
        return self.agent_dir is not None

    @property
    def completed_steps(self) -> int:  # in this process and round; the job's step is global_step
        return self._steps

    @property
    def global_step(self) -> int:
        """The job's step: the restored checkpoint's step plus the steps completed since."""
        return self._base + self._steps

    def set_step(self, step: int) -> None:
        """The global step of the last completed step (the checkpoint's, after a restore; FlashCheckpointer's
        restore sets it): :meth:`on_stop`, the drain and the agent's events then count the job's steps."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0 (the global step restored), got {step!r}")
        self._base = step - self._steps

    def newest_step(self) -> tuple[int, float] | None:
        """(global step, unix time of its end) of the newest step this process completed; None before its
        first. A restore report carries it: the agent's own view lags by up to one batch of step times."""
        if self._newest is None:
            return None
        step, at = self._newest
        return step, time.time() - (time.perf_counter() - at)

    def send_after_next_step(self, kind: int, body: bytes) -> None:
        """One datagram for the agent right after the next step (a restore report ends the downtime)."""
        self._after_step_msg = self._header(kind) + body

    def on_stop(self, hook: Callable[[int], None]) -> Callable[[int], None]:
        """Register the final-checkpoint hook, called with the last completed global step (see
        :attr:`global_step`) before the stop is acknowledged. Usable as a decorator. Default: nothing."""
        self._hook = hook
        return hook

    def reset_timer(self) -> None:
        """Start the next step's clock now (after warm-up, evaluation or a checkpoint outside the loop)."""
        self._last = time.perf_counter()
        self._last_busy = self._clock.read()

    def should_stop(self) -> bool:
        """True once a drain was agreed at a step boundary (the hook has run)."""
        return self._stopping

    def drain_requested(self) -> bool:
        """The agent's raw request, before any cross-rank agreement; for logging, not for stopping."""
        mm = self._mm
        return mm is not None and CONTROL.unpack_from(mm)[2] != 0

    def new_round(self, after_first_step: Callable[[], None] | None = None) -> None:
        """Start a new round in this same process (:mod:`elastic_rm.train.rounds`): steps count from 0
        again (ranks agree on stopping every ``sync_every`` steps of *this* round, fresh ranks too), the
        rank is read again from the environment, and the agent hears a hello with it.
        ``after_first_step`` runs once, after the round's first step."""
        self._base, self._steps = self._base + self._steps, 0  # the global step goes on
        self._stopping = self._drain = self._multi = False
        self._flag = None  # the all_reduce tensor of the old process group's backend
        self._rank, self._local_rank = _env_int("RANK"), _env_int("LOCAL_RANK")
        self._after_first_step = after_first_step
        self.send(KIND_HELLO)
        self.reset_timer()

    def send(self, kind: int, body: bytes = b"") -> bool:
        """One datagram of ``kind`` to the agent, retried on a full queue (not for the step path)."""
        if self.agent_dir is None or self._closed:
            return False
        return self._send(self._header(kind) + body, wait_s=RELIABLE_WAIT_S)

    def step(self, samples: int = 0) -> bool:
        """Mark the end of a step; True means stop now (all ranks stop at this same step)."""
        self._steps += 1
        if self._after_first_step is not None:
            hook, self._after_first_step = self._after_first_step, None
            hook()
        if self._after_step_msg is not None and self.agent_dir is not None and not self._closed:
            message, self._after_step_msg = self._after_step_msg, None
            self._send(message, wait_s=RELIABLE_WAIT_S)
        if self.agent_dir is None or self._stopping:
            return self._stopping
        now = time.perf_counter()
        busy = self._clock.read()
        wall = now - self._last
        self._durs.append(wall)
        self._busy.append(
            wall if busy is None or self._last_busy is None else min(busy - self._last_busy, wall)
        )
        self._last, self._last_busy = now, busy
        self._newest = (self.global_step, now)
        self._samples += samples
        if not len(self._durs) % MAX_BATCH or now - self._flushed >= self._flush_interval:
            self._flush(now)
            # The flag is read here, not every step: touching the shared page after a long compute step
            # costs microseconds (cold TLB/cache); a drain seen up to one flush interval later is fine.
            self._drain = self._mm is not None and CONTROL.unpack_from(self._mm)[2] != 0
        stop = self._drain
        if self.sync_every and self._multi_rank():
            if self._steps % self.sync_every:
                return False
            stop = self._agree(stop)
        elif stop and self._multi_rank():
            if not self._warned_unsynced:
                self._warned_unsynced = True
                log.warning(
                    "elastic-rm: drain requested but this is a multi-rank job and get_reporter() was not "
                    "given sync_every; not stopping alone (peers would hang). The agent will terminate the "
                    "workers after its grace period. Pass sync_every=N to stop cleanly."
                )
            return False
        if stop:
            self._finish()
        return self._stopping

    def iterate(self, iterable: Iterable[T], samples: int | Callable[[T], int] = 0) -> Iterator[T]:
        """Yield the items of ``iterable``, calling :meth:`step` after each one's body; ends early (like
        an exhausted loader) on a drain, so check :meth:`should_stop` after the loop."""
        count: Callable[[T], int]
        count = samples if callable(samples) else (lambda _item: samples)  # type: ignore[assignment]
        if self._stopping:
            return
        self.reset_timer()
        for item in iterable:
            yield item
            if self.step(count(item)):
                return

    def close(self) -> None:
        """Flush pending step times and tell the agent this worker is gone. Called at exit."""
        if self.agent_dir is None or self._closed or os.getpid() != self._pid:
            return  # nothing to tell, told already, or a forked child (a data-loader worker) exiting
        self._closed = True
        if not self._stopping:
            self._flush(time.perf_counter(), wait_s=RELIABLE_WAIT_S)
            self._send(self._header(KIND_BYE), wait_s=RELIABLE_WAIT_S)
        if self._sock is not None:
            self._sock.close()
        self._sock = None
        self._reconnect_at = float("inf")  # a step() after close() stays local
        if self._mm is not None:
            self._mm.close()
            self._mm = None

    # ---- internals -----------------------------------------------------------------------------------
    def _finish(self) -> None:
        self._flush(time.perf_counter(), wait_s=RELIABLE_WAIT_S)
        status = ACK_OK
        try:
            if self._hook is not None:
                self._hook(self.global_step)
        except BaseException:
            status = ACK_HOOK_FAILED
            raise
        finally:
            self._stopping = True
            self._send(self._header(KIND_ACK) + ACK.pack(self.global_step, status), wait_s=RELIABLE_WAIT_S)
            self._send(self._header(KIND_BYE), wait_s=RELIABLE_WAIT_S)

    def _multi_rank(self) -> bool:
        if not self._multi:  # a process group, once initialised, stays: cache only the True answer
            self._multi = _world_size(self._group) > 1
        return self._multi

    def _agree(self, stop: bool) -> bool:
        import torch
        import torch.distributed as dist

        if self._flag is None:
            backend = dist.get_backend(self._group)
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
            self._flag = torch.zeros(1, dtype=torch.int32, device=device)
        self._flag.fill_(1 if stop else 0)
        dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(self._flag.item())

    def _header(self, kind: int) -> bytes:
        return HEADER.pack(MAGIC, VERSION, kind, self._pid, self._rank, self._local_rank)

    def _flush(self, now: float, wait_s: float = 0.0) -> None:
        """Send the pending step times as one datagram. A full agent queue keeps them for the next try
        (merged, so nothing is lost unless MAX_PENDING overflows); the step path never waits."""
        self._flushed = now
        durs = self._durs
        if not durs:
            return
        if len(durs) > MAX_PENDING:
            drop = len(durs) - MAX_PENDING
            self._samples -= self._samples * drop // len(durs)  # keep samples/s right for what remains
            del durs[:drop]
            del self._busy[:drop]
            self._dropped += drop
        n = len(durs)
        body = STEPS.pack(self.global_step, self._samples, n) + struct.pack(f"<{2 * n}d", *durs, *self._busy)
        if self._send(self._header(KIND_STEPS) + body, wait_s=wait_s, count_drop=False):
            self._durs = []
            self._busy = []
            self._samples = 0

    def _connect(self) -> None:
        assert self.agent_dir is not None
        self._reconnect_at = time.perf_counter() + 1.0
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
        try:
            sock.connect(os.path.join(self.agent_dir, SOCKET_NAME))
        except OSError as exc:
            sock.close()
            if not self._warned_unreachable:
                self._warned_unreachable = True
                log.warning(
                    "elastic-rm: agent socket in %s unreachable (%s); step times are dropped",
                    self.agent_dir,
                    exc,
                )
            return
        if self._sock is not None:
            self._sock.close()
        self._sock = sock

    def _send(self, data: bytes, wait_s: float = 0.0, count_drop: bool = True) -> bool:
        """One non-blocking datagram; with ``wait_s`` retry a full queue that long. True when sent."""
        deadline = time.perf_counter() + wait_s
        while True:
            if self._sock is None and (wait_s or time.perf_counter() >= self._reconnect_at):
                self._connect()
            if self._sock is not None:
                try:
                    self._sock.send(data)
                    return True
                except BlockingIOError:
                    pass  # the agent's queue is full (net.unix.max_dgram_qlen): it is behind
                except OSError:
                    self._sock.close()  # the agent went away (restarted?): reconnect at most once a second
                    self._sock = None
            if time.perf_counter() >= deadline:
                if count_drop:
                    self._dropped += 1
                return False
            time.sleep(0.005)


_REPORTER: StepReporter | None = None
_WAITING: list[tuple[int, Callable[[StepReporter], None]]] = []  # (pid, call) until the reporter exists


def when_ready(call: Callable[[StepReporter], None]) -> None:
    """``call(reporter)`` now, or when :func:`get_reporter` makes this process's reporter."""
    if _REPORTER is not None and _REPORTER._pid == os.getpid():
        call(_REPORTER)
    else:
        _WAITING.append((os.getpid(), call))


def current_reporter() -> StepReporter | None:
    """This process's reporter if :func:`get_reporter` made it already, else None (makes nothing)."""
    if _REPORTER is not None and _REPORTER._pid == os.getpid():
        return _REPORTER
    return None


def get_reporter(**kwargs: Any) -> StepReporter:
    """The process's reporter, made on first call with these keyword arguments (see
    :class:`StepReporter`); later calls return the same one and must not pass different arguments."""
    global _REPORTER
    if _REPORTER is None or _REPORTER._pid != os.getpid():
        _REPORTER = StepReporter(**kwargs)
        atexit.register(_REPORTER.close)
        waiting, _WAITING[:] = [call for pid, call in _WAITING if pid == os.getpid()], []
        for call in waiting:
            call(_REPORTER)
    elif kwargs and (
        kwargs.get("sync_every", _REPORTER.sync_every) != _REPORTER.sync_every
        or kwargs.get("agent_dir", _REPORTER.agent_dir) != _REPORTER.agent_dir
    ):
        raise ValueError(
            "get_reporter() was already called with other arguments; pass them on the first call only"
        )
    return _REPORTER


def _report_restore(result: RestoreResult, world_after: int) -> None:
    """Set the reporter's global step to the restored one; its agent hears the report after the next step
    (now, or when the script makes its reporter after restoring). A process that trained before the restore
    (a round in place) says its newest step: that step, not the agent's last report, starts the downtime."""

    def tell(reporter: StepReporter) -> None:
        body = encode_restored(
            max(0, _env_int(ENV_ROUND)),
            result.step,
            int(result.manifest.get("world_size", world_after)),
            world_after,
            result.file_sources,
            result.load_s,
            step_before=reporter.newest_step(),
        )
        reporter.set_step(result.step)
        reporter.send_after_next_step(KIND_RESTORED, body)

    when_ready(tell)


listen_for_restores(_report_restore)
