"""Rounds in place: a training script that keeps its process across rounds.

Why: a new round that starts new worker processes pays Python's start, ``import torch, torchrec``, the
DMP build and the restore, 5-6 s on a quiet machine and far more on a busy one. A worker that opts in with
:func:`rounds` stays: at a planned round the agent drains it as always (the final flash checkpoint at a
step boundary), then tells it the new round over the worker channel instead of killing it. The worker
destroys its process groups, takes the new round's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``
and ``MASTER_PORT``, checkpoint peers, ...), initialises the new process group and runs the loop body
again, which re-plans the sharding, rebuilds the DMP and restores from node memory. A rank whose node
leaves the world exits 0.

A lost peer: a body run inside ``with rnd:`` whose collectives fail (a member died: gloo's sockets to it
error at once) does not end the process. The failure is held, the process groups are destroyed (which
makes the other survivors' collectives fail too; the agent hears about it first), and the worker waits in
place: when the rendezvous forms the round without the lost member, the agent hands it that round and
the body runs again, restoring from the newest committed checkpoint (the lost node's shards from the peer
that holds their replica). When no new round comes within the membership grace, the agent tells the
worker to fail, and it raises the held exception: today's restart. See docs/train.md, "Rounds in place".

    reporter = get_reporter(sync_every=5)
    for rnd in rounds(reporter):          # the process group of this round is initialised
        finished = False
        with rnd:                          # a failed collective: wait for the next round in place
            finished = train(...)          # build, restore, train; stop when reporter.step() says so
        if finished:
            break                          # training is over: no more rounds

Without an agent (plain torchrun) or when the body ends without a drain, it yields one round only.
"""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..wire.channel import (
    ENV_PREPARED,
    ENV_ROUND,
    KIND_FAILED,
    KIND_INPLACE,
    KIND_LOST,
    KIND_RESUMED,
    MAX_TEXT,
    RESUMED,
    ROUND_FAIL,
    ROUND_FILE,
    ROUND_LEAVE,
    STACKS_BODY,
    STACKS_SIGNAL,
    decode_round,
)
from .held_failure import say_held
from .master_store import WAIT_LIMIT_S, wait_for_master_store
from .report import StepReporter
from .round_memory import release_round_memory, trim_heap

log = logging.getLogger(__name__)

POLL_S = 0.005  # how often a parked worker looks for its round message
PARK_LIMIT_S = float(os.environ.get("ERM_PARK_LIMIT_S", "3600"))  # bound on waiting for the next round
PREPARED_WAIT_S = 120.0  # a worker started before the seal: bound on waiting for rank 0's store (the drain)


class RoundFailedError(RuntimeError):
    """A round's body failed (held by ``with rnd:``) and the agent saw no new round to move into."""


@dataclass(frozen=True)
class Round:
    """One round as the worker sees it; ``index`` 0 is the round the process started in.

    ``with rnd:`` around the body holds an exception of the round's body (a collective that failed
    because a peer died) instead of letting it end the process; :func:`rounds` then waits for the agent's
    decision. Outside an elastic-rm agent, and in a world of one node, the exception propagates."""

    index: int
    round_id: int
    rank: int
    world_size: int
    failure: list[str] = field(default_factory=list, repr=False, compare=False)
    can_wait: bool = field(default=False, repr=False, compare=False)
    # wall-clock times (``time.time()``) of this round's re-initialisation in this process, for profiles:
    # ``stopped`` (the body ended), ``told`` (the agent's round message read), ``group`` (the new process
    # group initialised); empty in the first round
    times: dict[str, float] = field(default_factory=dict, repr=False, compare=False)
    _prepared: list[Any] = field(default_factory=list, repr=False, compare=False)
    # tells the agent that this round's failure is held (rounds() sets it): called before the log's
    # traceback and whatever the script runs after the body (its gc.collect), which take seconds under
    # load while the agent, seeing the round after the loss, waits for the hold (agent/inplace.py)
    on_hold: Callable[[str], None] | None = field(default=None, repr=False, compare=False)
    _inside: list[bool] = field(default_factory=list, repr=False, compare=False)  # within `with rnd:`

    @property
    def in_place(self) -> bool:
        """True when this process trained an earlier round (it must restore, not initialise)."""
        return self.index > 0

    def take_prepared(self) -> Any:
        """What :func:`rounds`' ``prepare`` returned for this round (None without one), once: the body
        owns it, and this round's collection at its end must not find its model still held here."""
        return self._prepared.pop() if self._prepared else None

    def __enter__(self) -> Round:
        self._inside.append(True)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._inside:
            self._inside.pop()
        if exc is None or not isinstance(exc, Exception) or not self.can_wait:
            return False
        # the text only: the traceback would keep the old round's model and groups alive while we wait
        text = f"{type(exc).__name__}: {exc}"
        self.failure.append(text)
        if self.on_hold is not None:
            self.on_hold(text)
        say_held(log, self.round_id, self.rank, exc)  # one line here, the traceback in the log directory
        return True  # held: rounds() waits for the agent's next round


def rounds(
    reporter: StepReporter, backend: str = "gloo", prepare: Callable[[], Any] | None = None
) -> Iterator[Round]:
    """Yield one :class:`Round` per round this process trains in, its default process group initialised.

    ``prepare``: called once per round with the round's environment set (``WORLD_SIZE``, ``RANK``, ...)
    but before its process group is initialised; its result is ``rnd.take_prepared()``. Build there what needs
    no collective (the unsharded model, the sharding plan for this world): the group's initialisation
    waits for the slowest rank (a joining node's worker), and that wait then does this work.

    After a body that the agent drained (``reporter.should_stop()``), the process groups are destroyed
    and the worker waits for its next round; a leaving rank exits 0 (``SystemExit(0)``). After a body
    whose failure ``with rnd:`` held, the agent hears it, the round's connections and groups are ended,
    and the worker waits for the next round the same way, or raises :class:`RoundFailedError` when the
    agent says none came. A body that ends any other way (``break`` or done) ends the iteration, and the
    script's own cleanup follows the loop.
    """
    _freeze_imports()  # first: nothing of a round (its prepared model included) may be frozen
    index, round_id, times = 0, _env_round(), {}
    # started before its round was sealed: rank 0's store comes up once the kept nodes drained
    early = os.environ.pop(ENV_PREPARED, None) is not None
    prepared = _prepare(prepare, reporter, round_id, times)
    if not dist.is_initialized():
        # a refused first connect costs torch's back-off (master_store.py)
        wait_for_master_store(PREPARED_WAIT_S if early else WAIT_LIMIT_S)
        dist.init_process_group(backend)
        times["group"] = time.time()
    while True:
        rnd = Round(
            index,
            round_id,
            dist.get_rank(),
            dist.get_world_size(),
            can_wait=_can_wait(reporter),
            times=times,
            _prepared=[prepared] if prepare is not None else [],
            on_hold=_held(reporter, round_id),
        )
        if reporter.active:
            resumed = _resumed(reporter, round_id) if index else None
            reporter.new_round(after_first_step=_first_step(rnd, resumed))
            reporter.send(KIND_INPLACE, STACKS_BODY if _stacks_on_signal() else b"")
        prepared = None  # the round's body owns it now
        yield rnd
        t0 = time.monotonic()
        times = {"stopped": time.time()}
        if rnd.failure:  # the body's collectives failed (a lost peer?): wait for the agent's decision
            failure = rnd.failure.pop()  # the agent heard it from on_hold
            _drop_groups(reporter)
            release_round_memory()
            action, round_id, env = _wait_for_round(reporter.agent_dir)
            if action == ROUND_FAIL:
                raise RoundFailedError(f"round {rnd.round_id} failed and no new round came: {failure}")
        elif not (reporter.active and reporter.should_stop()):
            return
        else:
            dist.destroy_process_group()  # the default group and every group made from it
            _release_round(reporter)
            action, round_id, env = _wait_for_round(reporter.agent_dir)
        times["told_round"] = time.time()
        if action == ROUND_LEAVE:
            log.info("elastic-rm: this rank leaves the world at round %d; exiting 0", round_id)
            raise SystemExit(0)
        index += 1
        os.environ.update(env)
        _forget_the_old_world()
        prepared = _prepare(prepare, reporter, round_id, times)
        try:
            wait_for_master_store()
            dist.init_process_group(backend)
        except Exception as exc:
            _report_failure(reporter, round_id, exc)
            raise
        times["group"] = time.time()
        log.info(
            "elastic-rm: round %d in place: rank %d of %d (%.2fs from the drain to the new process group)",
            round_id,
            dist.get_rank(),
            dist.get_world_size(),
            time.monotonic() - t0,
        )


def _prepare(
    prepare: Callable[[], Any] | None, reporter: StepReporter, round_id: int, times: dict[str, float]
) -> Any:
    """Run the script's ``prepare`` for the round ahead (no process group exists); a failure is told to
    the agent (which falls back to a restart) before it ends the process."""
    if prepare is None:
        return None
    try:
        out = prepare()
    except Exception as exc:
        _report_failure(reporter, round_id, exc)
        raise
    times["prepared"] = time.time()
    return out


def _freeze_imports() -> None:
    """Move every object alive now (the imported modules: torch, torchrec and the script's, some 10^5
    objects) out of the garbage collector's reach. Why: the end of a round collects the old round's model
    and groups, and a full collection that scans the imports too takes 0.5-1 s on a loaded 2-core
    machine (a few ms frozen), all of it downtime. Once per process, before any round's model exists, so
    no round's objects are frozen (they stay collectable)."""
    if not getattr(_freeze_imports, "done", False):
        gc.collect()  # what is garbage already is not frozen
        gc.freeze()
        _freeze_imports.done = True  # type: ignore[attr-defined]


def _stacks_on_signal() -> bool:
    """Print every thread's stack on the agent's ``STACKS_SIGNAL``, registered once per process; whether
    this process prints them now (the agent signals only a worker that said so at its round's start).
    Why: a worker that does not hold its failed round in time is restarted, and its stacks, printed from
    the signal handler even while a collective blocks, say where it waited. A script that handles the
    signal itself, before the first round or since, keeps its handler and is not sent the signal (a
    handler set with ``signal.signal`` replaces faulthandler's and shows in ``signal.getsignal``)."""
    if not hasattr(_stacks_on_signal, "registered"):
        registered = False
        if signal.getsignal(STACKS_SIGNAL) is signal.SIG_DFL and sys.__stderr__ is not None:
            try:
                faulthandler.register(STACKS_SIGNAL, file=sys.__stderr__, all_threads=True)
                registered = True
            except (AttributeError, OSError, RuntimeError, ValueError) as exc:  # no stderr descriptor
                log.debug("elastic-rm: no stack dump on signal %d: %r", STACKS_SIGNAL, exc)
        _stacks_on_signal.registered = registered  # type: ignore[attr-defined]
    registered: bool = _stacks_on_signal.registered  # type: ignore[attr-defined]
    return registered and signal.getsignal(STACKS_SIGNAL) is signal.SIG_DFL


def _forget_the_old_world() -> None:
    """Process-wide state that libraries set once per process, assuming one world per process: set
    again for the new world, or fresh ranks and kept ranks would run different collectives."""
    collective_utils = sys.modules.get("torchrec.distributed.collective_utils")
    if collective_utils is not None and hasattr(collective_utils, "_INITIALIZED"):
        # DistributedModelParallel broadcasts rank 0's collective-validation flag once per process
        collective_utils._INITIALIZED = False
    comm = sys.modules.get("torchrec.distributed.comm")
    for name in ("_INTRA_PG", "_CROSS_PG"):  # intra/cross-node groups of the old world, cached
        if comm is not None and hasattr(comm, name):
            setattr(comm, name, None)


def _can_wait(reporter: StepReporter) -> bool:
    """A failed round is worth waiting for in place under an agent that handles it, in a world of more
    than one node (alone, no peer's loss can have failed it: the agent restarts it at once)."""
    try:
        nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    except ValueError:
        nodes = 1
    return reporter.active and nodes > 1


def _release_round(reporter: StepReporter) -> None:
    """After a drained round: drop its final-checkpoint hook, which holds the old round's model and
    checkpointer, so that the next round's build does not hold two models at once, and give back what
    the round held (:mod:`.round_memory`)."""
    reporter.on_stop(lambda _step: None)
    release_round_memory()


def _drop_groups(reporter: StepReporter) -> None:
    """End the failed round's process groups so that the survivors still waiting on this rank in a
    collective fail at once (then hold their failure too) instead of at the group's timeout.

    gloo cannot do that by itself: neither ``destroy_process_group`` nor ``abort`` closes its connections
    while the process lives, and a rank waiting on a live peer (which waits on the dead one) would wait.
    So the TCP connections of this process are shut down (``shutdown``, not ``close``: gloo still owns the
    descriptors and closes them when its objects go). The worker has no other TCP connection that outlives
    the round (the agent's channel is a Unix socket; the new round makes a new store connection)."""
    t0 = time.monotonic()
    shut = _shut_tcp_connections()
    reporter.on_stop(lambda _step: None)  # the final-checkpoint hook holds the old model and checkpointer
    gc.collect()
    t1 = time.monotonic()
    try:
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - a broken group may refuse; the new round makes new ones
        log.warning("elastic-rm: destroying the failed round's process groups: %r", exc)
    log.info(
        "elastic-rm: the failed round's %d connection(s) shut and its objects collected in %.2fs, its "
        "groups destroyed in %.2fs",
        shut,
        t1 - t0,
        time.monotonic() - t1,
    )


def _shut_tcp_connections() -> int:
    """Shut down every TCP connection of this process (both directions); returns how many."""
    done = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except (OSError, ValueError):
            continue
        try:
            sock = socket.socket(fileno=fd)  # owns the duplicate only
        except OSError:
            os.close(fd)  # not a socket
            continue
        with sock:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            try:
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                    continue  # a listener: gloo's would abort the process on a failed accept
                sock.getpeername()  # connected ones only
                sock.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
    return done


def _held(reporter: StepReporter, round_id: int) -> Callable[[str], None]:
    def send(failure: str) -> None:
        reporter.send(KIND_LOST, RESUMED.pack(round_id) + failure.encode()[:MAX_TEXT])

    return send


OUTSIDE_WARNING = (
    "elastic-rm: this round's body trains outside `with rnd:`: after a peer's loss this node's workers "
    "are restarted (new processes, the model built again) instead of waiting in place. A for-loop body's "
    "exception never reaches the generator: write the loop as `elastic_run(train)` or "
    "`for rnd in elastic_rounds(): with rnd: train()`"
)


def _first_step(rnd: Round, resumed: Callable[[], None] | None) -> Callable[[], None]:
    """After the round's first step: tell the agent a round in place resumed, and say once per process
    (local rank 0) when the body trains outside ``with rnd:`` in a world where a loss could be held."""

    def after() -> None:
        if resumed is not None:
            resumed()
        if rnd.can_wait and not rnd._inside and not getattr(_first_step, "warned", False):
            _first_step.warned = True  # type: ignore[attr-defined]
            if os.environ.get("LOCAL_RANK", "0") == "0":
                log.warning("%s", OUTSIDE_WARNING)

    return after


def _resumed(reporter: StepReporter, round_id: int):
    def send() -> None:
        reporter.send(KIND_RESUMED, RESUMED.pack(round_id))
        trim_heap()  # after the agent heard it: what the round's build and restore freed goes back

    return send


def _report_failure(reporter: StepReporter, round_id: int, exc: BaseException) -> None:
    """Tell the agent why re-initialising failed (its event log says so), before the exception ends us."""
    reporter.send(KIND_FAILED, RESUMED.pack(round_id) + f"{type(exc).__name__}: {exc}".encode()[:MAX_TEXT])


def _env_round() -> int:
    try:
        return int(os.environ.get(ENV_ROUND, "0"))
    except ValueError:
        return 0


def _wait_for_round(agent_dir: str | None) -> tuple[int, int, dict[str, str]]:
    """Block until the agent's round message for this process arrives (bounded; the agent's death ends
    the wait at once: nobody would ever send it)."""
    assert agent_dir is not None
    path = os.path.join(agent_dir, ROUND_FILE.format(pid=os.getpid()))
    parent = os.getppid()
    deadline = time.monotonic() + PARK_LIMIT_S
    while time.monotonic() < deadline:
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except FileNotFoundError:
            if os.getppid() != parent:
                raise SystemExit(
                    "elastic-rm: the agent is gone while this worker waited for its next round"
                ) from None
            time.sleep(POLL_S)
            continue
        os.unlink(path)
        return decode_round(data)
    raise SystemExit(f"elastic-rm: no next round within {PARK_LIMIT_S:.0f}s (ERM_PARK_LIMIT_S); exiting")
