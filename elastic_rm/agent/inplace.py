"""Agent side of rounds in place: move drained workers that opted in (:mod:`elastic_rm.train.rounds`)
into the new round instead of stopping them and starting new processes.

Why: starting workers costs seconds per round (Python, ``import torch, torchrec``, the DMP build); a
worker that keeps its process only re-initialises its process group and restores from node memory.

The round, on a node whose workers all opted in and all drained cleanly:
1. the pending round leaves this node out: each worker is told to leave and exits 0; torch's restart
   follows (this node then waits as standby, holding no workers);
2. otherwise the agent runs torch's rendezvous (new group rank, world size, master address and port, and
   the global ranks of torch's rank assignment), writes each worker its new environment, and waits until
   every worker trained its first step in the new round. torch's bookkeeping stays its own: the
   ``WorkerGroup`` gets the rendezvous' workers with the kept pids, the restart count is untouched (a
   membership change is no restart) and the exit barrier uses the new round's store.
Any failure (a worker exits or reports an error while re-initialising, no resume in time, a newer round
forming meanwhile) is said in the event log, and torch's restart follows: stop, rendezvous, new processes.

After a member's loss (:meth:`InPlaceRounds.run_after_loss`): the workers' collectives failed, and each
worker that holds the failure (``with rnd:``) said so (``KIND_LOST``), shut its connections, destroyed its
process groups and waits. When the round without the lost member forms, the agent moves them into it as
above, with no drain: their body restores from the newest committed checkpoint. When no new round forms
within the membership grace, the agent tells them to fail (:meth:`InPlaceRounds.release`), and torch's
failure handling follows as if they had exited at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

import psutil
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState

from ..checkpoint.peers import PEERS_ENV
from ..obs.events import EventLog
from ..wire.channel import (
    ENV_ROUND,
    KIND_FAILED,
    KIND_INPLACE,
    KIND_LOST,
    KIND_RESUMED,
    RESUMED,
    ROUND_FAIL,
    ROUND_JOIN,
    ROUND_LEAVE,
    STACKS_BODY,
    STACKS_SIGNAL,
)
from .channel import AgentChannel, DrainResult, pid_alive
from .host import AgentHost

log = logging.getLogger(__name__)

REINIT_LIMIT_S = 120.0  # how long workers may take from the round message to their first step
LEAVE_LIMIT_S = 30.0  # how long leaving workers may take to exit
# After a loss, how long the agent waits for every local worker to hold its failed round: the first
# worker's shut connections make the others' collectives fail at once, so this is only a bound.
LOST_LIMIT_S = 5.0
# ... and how long, when none holds one yet: on a loaded machine a worker can hold its failure after the
# lease expired; a frozen peer (SIGSTOP) fails no collective, and its survivors restart after this wait.
FIRST_HOLD_LIMIT_S = 1.0
RELEASE_LIMIT_S = 30.0  # how long workers told to fail their held round may take to exit
STACKS_WAIT_S = 0.5  # how long a worker asked for its stacks may take to take the signal, before its restart
STACKS_PRINT_S = 0.05  # ... and, once taken, to print them (within STACKS_WAIT_S)


class InPlaceRounds:
    """Which workers opted in, their resumes and failures (from the channel), and the round itself."""

    def __init__(self, channel: AgentChannel, events: EventLog) -> None:
        self.channel = channel
        self.events = events
        self._cond = threading.Condition()
        # workers that opted in: pid -> the process's start time (None: gone when it said so), so that a
        # later process given the same pid, which never said so, is not taken for one that did
        self._capable: dict[int, float | None] = {}
        # of those, the ones that print their stacks on STACKS_SIGNAL (signalled only while ``_opted``
        # finds the same process: a later process with the pid would die of the signal)
        self._prints_stacks: set[int] = set()
        self._resumed: dict[int, int] = {}  # pid -> round id it trained a first step in
        self._failed: dict[int, str] = {}  # pid -> why its re-init failed
        self._lost: dict[int, tuple[float, str]] = {}  # pid -> (monotonic time, why) of its failed round
        self.on_capable: Callable[[], None] | None = None  # called at the first worker that opted in
        channel.extra_handlers[KIND_INPLACE] = self._on_inplace
        channel.extra_handlers[KIND_RESUMED] = self._on_resumed
        channel.extra_handlers[KIND_FAILED] = self._on_failed
        channel.extra_handlers[KIND_LOST] = self._on_lost

    # ---- channel messages (the channel's thread) ------------------------------------------------------
    def _on_inplace(self, pid: int, body: bytes) -> None:
        created = _start_time(pid)
        with self._cond:
            first = not self._capable
            self._capable[pid] = created
            if body == STACKS_BODY and created is not None:
                self._prints_stacks.add(pid)
            else:  # it stopped printing them (its script took the signal), or it is gone
                self._prints_stacks.discard(pid)
        if first and self.on_capable is not None:
            try:
                self.on_capable()
            except Exception as exc:  # noqa: BLE001 - etcd trouble: joining nodes then start at the seal
                log.warning("could not say in this node's record that its workers stay in place: %r", exc)

    def _on_resumed(self, pid: int, body: bytes) -> None:
        (round_id,) = RESUMED.unpack_from(body)
        with self._cond:
            self._resumed[pid] = round_id
            self._cond.notify_all()

    def _on_failed(self, pid: int, body: bytes) -> None:
        (round_id,) = RESUMED.unpack_from(body)
        text = body[RESUMED.size :].decode(errors="replace")
        with self._cond:
            self._failed[pid] = f"round {round_id}: {text}"
            self._cond.notify_all()

    def _on_lost(self, pid: int, body: bytes) -> None:
        (round_id,) = RESUMED.unpack_from(body)
        text = body[RESUMED.size :].decode(errors="replace")
        with self._cond:
            self._lost[pid] = (time.monotonic(), f"round {round_id}: {text}")
            self._cond.notify_all()

    def _opted(self, pids: list[int]) -> set[int]:
        """The workers of ``pids`` that opted in: the process that said so (or gone since), never a later
        process with its pid (a worker of a restart that does not use rounds would be waited for)."""
        with self._cond:
            said = {p: self._capable[p] for p in pids if p in self._capable}
        return {p for p, started in said.items() if (now := _start_time(p)) is None or now == started}

    # ---- workers waiting after their round failed ------------------------------------------------------
    def waiting_s(self, pids: list[int]) -> float | None:
        """Seconds since the first of ``pids`` said its round failed and it waits in place; None: none."""
        with self._cond:
            since = [self._lost[p][0] for p in pids if p in self._lost]
        return time.monotonic() - min(since) if since else None

    def release(self, pids: list[int]) -> str:
        """No new round came: the waiting workers fail (they raise, and exit as they would have at once).
        Returns why their rounds failed, for the event log."""
        with self._cond:
            waiting = {p: self._lost.pop(p) for p in pids if p in self._lost}
        for pid in waiting:
            self.channel.send_round(pid, ROUND_FAIL, 0, {})
        return "; ".join(f"pid {p}: {why}" for p, (_, why) in sorted(waiting.items()))

    def held_failure(
        self,
        agent: AgentHost,
        group: WorkerGroup,
        result: RunResult,
        monitor: Callable[[WorkerGroup], RunResult],
    ) -> RunResult:
        """Workers that hold a failed round run on, waiting: a new round within the membership grace takes
        them in place (torch's loop sees the waiting nodes); without one, they are told to fail and exit,
        and ``monitor`` (torch's) reports their failure as it would have at once."""
        pids = [w.id for w in group.workers if w.id is not None]
        waited = self.waiting_s(pids)
        if waited is None or group.spec.rdzv_handler.num_nodes_waiting() > 0:
            return result
        grace = agent.membership_grace()
        if waited < grace:
            return result
        why = self.release(pids)
        deadline = time.monotonic() + RELEASE_LIMIT_S
        while result.state == WorkerState.HEALTHY and time.monotonic() < deadline:
            time.sleep(0.05)
            result = monitor(group)
        left = agent.remaining_restarts
        outcome = f"{left} restart(s) left" if left > 0 else "no restarts left"
        agent.emit_failure(result, f"no new round within the membership grace {grace:g}s ({why}); {outcome}")
        return result

    def run_after_loss(self, agent: AgentHost, group: WorkerGroup) -> bool:
        """A new round after a member's loss: True when the workers, which held their failed round and
        wait in place, moved into it (their body restores the newest committed checkpoint). False: torch's
        restart must follow (the event log says why, when the workers opted in)."""
        old = {w.local_rank: w.id for w in group.workers if w.id is not None}
        pids = sorted(old.values())
        opted = bool(self._opted(pids))
        if not pids or not opted or agent.services is None:
            return False
        limit_s = LOST_LIMIT_S if self.waiting_s(pids) is not None else FIRST_HOLD_LIMIT_S
        why, late = self._wait_lost(pids, limit_s)
        with self._cond:
            since = min((self._lost.pop(p)[0] for p in pids if p in self._lost), default=time.monotonic())
        if why is not None:
            shown = self.show_stacks(late)
            if shown:
                why += (
                    f"; pid(s) {shown} were asked to print their stacks (where they waited) to the node's log"
                )
            self.events.emit(
                "round", f"round after the loss not in place: {why}; restarting the workers", in_place=False
            )
            return False
        pending = agent.services.pending_round
        if pending is not None and pending.members and agent.services.node_id not in pending.members:
            self._leave(agent, pending.round, pids)
            return False
        return self._move(agent, group, old, since, after_loss=True)

    def show_stacks(self, pids: list[int]) -> list[int]:
        """Make each live worker of ``pids`` that said it prints its threads' stacks on ``STACKS_SIGNAL``
        print them to its log, and wait (at most ``STACKS_WAIT_S``) until each took the signal: the
        restart that follows would otherwise end it with the signal still pending, and nothing printed.
        Only those that said so, in the same process (by its start time): another process could die of
        the signal, or take it for its own. Returns the pids signalled."""
        with self._cond:
            registered = [p for p in pids if p in self._prints_stacks]
        same = self._opted(registered)
        shown = []
        for pid in registered:
            if pid not in same or not pid_alive(pid):
                continue
            try:
                os.kill(pid, STACKS_SIGNAL)
            except ProcessLookupError:
                continue
            shown.append(pid)
        deadline = time.monotonic() + STACKS_WAIT_S
        while any(_signal_pending(p, STACKS_SIGNAL) for p in shown) and time.monotonic() < deadline:
            time.sleep(0.005)
        if shown:  # taken is not yet printed: the handler runs once the worker's thread next runs
            time.sleep(max(0.0, min(STACKS_PRINT_S, deadline - time.monotonic())))
        return shown

    def _wait_lost(self, pids: list[int], limit_s: float) -> tuple[str | None, list[int]]:
        """(None, []) once every worker said it waits in place after its round failed; else why not,
        and the live workers that did not hold it within ``limit_s`` (none when the wait ended early)."""
        deadline = time.monotonic() + limit_s
        while True:
            capable = self._opted(pids)
            with self._cond:
                missing = [p for p in pids if p not in self._lost]
            if len(capable) != len(pids):
                return f"{len(pids) - len(capable)} worker(s) do not use elastic_rm.train.rounds", []
            if not missing:
                return None, []
            dead = [p for p in missing if not pid_alive(p)]
            if dead:
                return f"worker pid(s) {dead} exited (a script without `with rnd:` around its body?)", []
            if time.monotonic() > deadline:
                return f"worker pid(s) {missing} did not hold a failed round within {limit_s:g}s", missing
            with self._cond:
                self._cond.wait(0.05)

    # ---- the round ------------------------------------------------------------------------------------
    def why_not(self, pids: list[int], drained: DrainResult | None) -> str | None:
        """None when every worker opted in and drained cleanly; else why the round cannot be in place."""
        if drained is None:
            return "the workers were not drained"
        capable = self._opted(pids)
        if len(capable) != len(pids):
            return f"{len(pids) - len(capable)} worker(s) do not use elastic_rm.train.rounds"
        if set(drained.acked) != set(pids):
            return "not every worker drained cleanly (a final hook failed, or it exited or timed out)"
        return None

    def run(self, agent: AgentHost, group: WorkerGroup, drained: DrainResult | None) -> bool:
        """The round in place; True when the workers kept their processes in it. False: torch's restart
        must follow (this node leaves, or the in-place path failed and the event log says why)."""
        old = {w.local_rank: w.id for w in group.workers if w.id is not None}
        pids = sorted(old.values())
        why = self.why_not(pids, drained) if pids else "no workers"
        if why is not None:
            # a script that opted in hears why this round restarts it; others hear nothing new
            if self._opted(pids):
                self.events.emit(
                    "round", f"round not in place: {why}; restarting the workers", in_place=False
                )
            return False
        services = agent.services
        if services is None:  # torch's own backends: no view of the round to come
            return False
        pending = services.pending_round
        node = services.node_id
        if pending is not None and pending.members and node not in pending.members:
            self._leave(agent, pending.round, pids)
            return False
        return self._move(agent, group, old, time.monotonic(), after_loss=False)

    def _move(
        self, agent: AgentHost, group: WorkerGroup, old: dict[int, int], t0: float, after_loss: bool
    ) -> bool:
        """Rendezvous, tell each kept worker its new round, wait for its first step there. ``t0``: when
        training stopped (the drain's end, or the first failed collective after a loss)."""
        services = agent.services
        pids = sorted(old.values())
        with self._cond:
            self._resumed.clear()
            self._failed.clear()
        self.channel.clear_drain()  # before any worker can train in the new round and see the old flag
        agent.rendezvous(group)
        rendezvous_at = time.time()
        joined = services.joined_round
        round_id = joined.round if joined is not None else 0
        for worker in group.workers:
            worker.id = old[worker.local_rank]  # the same processes: torch's monitor matches them by pid
        envs = self._environments(agent, group, round_id)
        for worker in group.workers:
            self.channel.send_round(worker.id, ROUND_JOIN, round_id, envs[worker.local_rank])
        told_at = time.time()
        why = self._wait_resumed(pids, round_id, lambda: group.spec.rdzv_handler.num_nodes_waiting() > 0)
        if why is not None:
            self.events.emit(
                "round",
                f"in-place round {round_id} failed: {why}; falling back to a restart (new processes)",
                round=round_id,
                in_place=False,
                fallback=why,
            )
            log.warning("in-place round %d failed: %s; restarting the workers", round_id, why)
            return False
        elapsed = time.monotonic() - t0
        group.state = WorkerState.HEALTHY
        self.channel.reset_steps()
        kept = (
            f"{len(pids)} worker(s) kept their processes, "
            f"rank(s) {[w.global_rank for w in group.workers]} of {group.workers[0].world_size}"
        )
        self.events.emit(
            "round",
            f"peer lost; round {round_id} in place, training again after {elapsed:.2f}s ({kept})"
            if after_loss  # the one line a recovery prints on each node's console
            else f"round {round_id} in place: {kept}; training again {elapsed:.2f}s after the drain",
            round=round_id,
            in_place=True,
            after_loss=after_loss,
            pids=pids,
            ranks=[w.global_rank for w in group.workers],
            world=group.workers[0].world_size,
            resume_s=round(elapsed, 3),
            rendezvous_at=rendezvous_at,  # wall-clock times, for profiles (benchmarks/recovery/breakdown.py)
            told_at=told_at,
        )
        return True

    def _environments(self, agent: AgentHost, group: WorkerGroup, round_id: int) -> dict[int, dict[str, str]]:
        """What torch's ``LocalElasticAgent._start_workers`` gives a new worker, plus elastic-rm's
        per-round variables (the checkpoint peers of this round, the node id, the round id)."""
        from . import ckpt_hooks

        spec = group.spec
        ckpt_hooks.set_worker_env(agent.services)
        restart_count = spec.max_restarts - agent.remaining_restarts
        node = agent.services.node_id if agent.services is not None else agent.node_id
        envs = {}
        for w in group.workers:
            envs[w.local_rank] = {
                "RANK": str(w.global_rank),
                "GROUP_RANK": str(group.group_rank),
                "ROLE_RANK": str(w.role_rank),
                "ROLE_NAME": spec.role,
                # as torch's _set_local_rank_env: under --virtual-local-rank each worker sees only its own
                # GPU, as device 0 (its CUDA_VISIBLE_DEVICES, set at its start, stays)
                "LOCAL_RANK": "0" if spec.virtual_local_rank else str(w.local_rank),
                "LOCAL_WORLD_SIZE": str(spec.local_world_size),
                "WORLD_SIZE": str(w.world_size),
                "GROUP_WORLD_SIZE": str(group.group_world_size),
                "ROLE_WORLD_SIZE": str(w.role_world_size),
                "MASTER_ADDR": str(group.master_addr),
                "MASTER_PORT": str(group.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restart_count),
                "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
                "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
                PEERS_ENV: os.environ.get(PEERS_ENV, ""),
                "ERM_NODE_ID": node,
                ENV_ROUND: str(round_id),
            }
        return envs

    def _leave(self, agent: AgentHost, round_id: int, pids: list[int]) -> None:
        """This node is not in the pending round: its workers exit 0 (no kill, no restart count)."""
        for pid in pids:
            self.channel.send_round(pid, ROUND_LEAVE, round_id, {})
        deadline = time.monotonic() + LEAVE_LIMIT_S
        result = None
        while time.monotonic() < deadline and result is None:
            context = agent.process_context
            result = context.wait(0) if context is not None else None  # all exited?
            time.sleep(0.02)
        if result is None:
            codes: dict[int, int | None] = {}
            outcome = f"not every worker exited within {LEAVE_LIMIT_S:.0f}s; stopping them"
        else:
            codes = {r: 0 for r in result.return_values} | {r: f.exitcode for r, f in result.failures.items()}
            outcome = "every worker exited 0" if not result.is_failed() else f"exit codes {codes}"
        self.events.emit(
            "round",
            f"round {round_id} leaves this node out: its {len(pids)} worker(s) left in place; {outcome}",
            round=round_id,
            in_place=True,
            left=pids,
            exit_codes={str(r): c for r, c in codes.items()},
        )

    def _wait_resumed(self, pids: list[int], round_id: int, newer_round: Callable[[], bool]) -> str | None:
        deadline = time.monotonic() + REINIT_LIMIT_S
        while True:
            with self._cond:
                failed = {p: t for p, t in self._failed.items() if p in pids}
                pending = [p for p in pids if self._resumed.get(p) != round_id]
            if failed:
                pid, text = next(iter(failed.items()))
                return f"worker pid {pid} raised while re-initialising ({text})"
            if not pending:
                return None
            dead = [p for p in pending if not pid_alive(p)]
            if dead:
                return f"worker pid(s) {dead} exited before their first step in the new round"
            if newer_round():
                return "a newer round formed before every worker resumed (a peer's re-init failed?)"
            if time.monotonic() > deadline:
                return f"worker pid(s) {pending} did not resume within {REINIT_LIMIT_S:.0f}s"
            with self._cond:
                self._cond.wait(0.05)


def _start_time(pid: int) -> float | None:
    """When process ``pid`` started (None: gone): tells a worker from a later process with its pid."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _signal_pending(pid: int, sig: int) -> bool:
    """Whether ``sig`` is still pending for process ``pid`` (/proc: the process's shared set and its main
    thread's); False once it was taken, or when the process is gone."""
    bit = 1 << (sig - 1)
    try:
        with open(f"/proc/{pid}/status") as f:
            masks = [line.split()[1] for line in f if line.startswith(("SigPnd:", "ShdPnd:"))]
    except OSError:
        return False
    return any(int(mask, 16) & bit for mask in masks)
