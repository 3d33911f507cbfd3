"""Prepared starts: a node that joins a running job starts its workers before the round is sealed.

Why: in a planned round (a scale-up, a straggler swap) the kept nodes drain first (a final flash
checkpoint at a step boundary), then ack, and the leader seals the round once every member acked. A
joining node's workers that start only then hold the round back: its process group waits for its slowest
rank: the joiner, whose script import, model build and sharding plan all came after the seal. Yet the
joiner can know its workers' whole environment as soon as the leader proposes the round: its group rank
(its index in the member list), the world (the members' ``nproc``), the master address (rank 0's record:
its address and the port it advertises, which its ack names; rendezvous/bootstrap.py), its checkpoint
peers and the round's id. So it starts its workers at its own ack, while the kept nodes drain; they
import, build and plan meanwhile, and wait for rank 0's store in ``init_process_group``.

Only when every other member's record says its workers keep their processes across rounds
(``NodeRecord.in_place``, from ``elastic_rm.train.rounds``): such a script touches no checkpoint before
its process group is up (its round body restores after it), and that group forms only after the drain,
so starting early cannot restore a step older than the drained one. A plain script might restore first.

At the seal, the environment torch's ``_start_workers`` would give each worker is computed again and
compared with the one given. Equal: the started workers are the round's (torch's ``WorkerGroup`` gets
their pids, its restart count is untouched). Different (another round was sealed, another master, other
peers) or a worker gone: they are stopped, the event log says why, and the round starts its workers as
it always did.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from torch.distributed.elastic.agent.server.api import WorkerGroup, WorkerSpec

from ..wire.channel import ENV_PREPARED
from ..wire.records import NodeRecord, RoundRecord
from .channel import pid_alive
from .host import AgentHost
from .spares import SpareContext, SparePool

log = logging.getLogger(__name__)

STOP_LIMIT_S = 5.0  # how long discarded workers get to exit after SIGTERM, before SIGKILL


def predicted_group(
    spec: WorkerSpec, r: RoundRecord, records: dict[str, NodeRecord], node: str
) -> WorkerGroup:
    """This node's ``WorkerGroup`` as torch's rendezvous and rank assignment will fill it for round ``r``:
    group rank = index in the member list, global ranks by the members' ``nproc`` in that order (torch's
    ``_assign_worker_ranks``, one role), master = rank 0's address and advertised port."""
    group = WorkerGroup(spec)
    index = r.members.index(node)
    base = sum(records[m].nproc for m in r.members[:index])
    world = sum(records[m].nproc for m in r.members)
    rank0 = records[r.members[0]]
    group.group_rank, group.group_world_size = index, len(r.members)
    # as torch's _rendezvous: a master given on the command line overrides the rendezvous' one
    group.master_addr = spec.master_addr or rank0.addr
    group.master_port = spec.master_port or rank0.master_port
    for worker in group.workers:
        worker.global_rank = worker.role_rank = base + worker.local_rank
        worker.world_size = worker.role_world_size = world
    return group


def whole(envs: dict[int, dict[str, str]]) -> dict[int, dict[str, str]]:
    """Each local rank's whole environment at its start: the agent's, with torch's worker variables."""
    return {rank: {**os.environ, **env} for rank, env in envs.items()}


@dataclass
class _Started:
    round: int
    expected: dict[int, dict[str, str]]  # what each rank was given (without ENV_PREPARED)
    context: SpareContext
    at: float  # time.time() of the start


class PreparedStart:
    """The agent's prepared workers: at most one set, for the round forming now."""

    def __init__(self, agent: AgentHost, pool: SparePool | None) -> None:
        self._agent = agent
        self._pool = pool
        self._started: _Started | None = None

    def on_forming_round(self, r: RoundRecord) -> None:
        """The handler's hook, on the agent's thread inside ``next_rendezvous``: never raises."""
        try:
            why = self._start(r)
            if why is not None:
                log.info("round %d: no prepared start of this node's workers: %s", r.round, why)
        except Exception as exc:  # noqa: BLE001 - the round then starts its workers as it always did
            why = f"{type(exc).__name__}: {exc}"
            log.warning("prepared start for round %d failed: %s", r.round, why)
        if why is not None and self._started is not None and self._started.round != r.round:
            self.discard(f"round {r.round} formed instead ({why})")

    def _start(self, r: RoundRecord) -> str | None:
        """Start the workers for round ``r`` if this node can (None: started, or kept); else why not."""
        agent, services, pool = self._agent, self._agent.services, self._pool
        if pool is None or services is None:
            return "no warm spares"
        if any(w.id is not None and pid_alive(w.id) for w in agent.get_worker_group().workers):
            return "this node's workers run (a kept node)"
        node = services.node_id
        records = services.node_records(list(r.members))
        if node not in r.members or len(records) != len(r.members) or len(records) < 2:
            return "a member's record is not known yet"
        if not all(rec.in_place for m, rec in records.items() if m != node):
            return "not every other member's workers keep their processes (elastic_rm.train.rounds)"
        if records[r.members[0]].master_port <= 0:
            return "rank 0 advertises no port"
        group = predicted_group(agent.get_worker_group().spec, r, records, node)
        agent.set_worker_environment(r.round)
        args, envs, prefixes = agent.worker_start(group)
        expected = whole(envs)
        if self._started is not None:  # their round id (ERM_ROUND) at least is not this round's
            self.discard(f"round {r.round} formed before round {self._started.round} was sealed")
        marked = {rank: {**env, ENV_PREPARED: str(r.round)} for rank, env in envs.items()}
        context = agent.start_workers_with(group, (args, marked, prefixes))
        self._started = _Started(r.round, expected, context, time.time())
        pids = context.pids()
        agent.guard_processes(list(pids.values()))
        agent.events.emit(
            "round",
            f"round {r.round}: {len(pids)} worker(s) started before the seal (prepared; "
            f"{len(context.from_spares)} from warm spares), while the kept nodes drain",
            round=r.round,
            prepared=True,
            master=[group.master_addr, group.master_port],  # predicted: the seal keeps them only if equal
            from_spares={str(rank): pid for rank, pid in sorted(context.from_spares.items())},
            new_processes=len(pids) - len(context.from_spares),
        )
        return None

    def take(self, group: WorkerGroup) -> dict[int, int] | None:
        """At the seal (torch's ``_start_workers``, the environment set): the prepared workers' pids when
        they fit the round that was sealed; None after stopping them (the event log says why) or when
        none were started."""
        started, self._started = self._started, None
        if started is None:
            return None
        joined = self._agent.joined_round
        if joined is None or joined.round != started.round:
            sealed = joined.round if joined is not None else "none"
            return self._drop(started, f"round {sealed} was sealed, not the prepared round {started.round}")
        now = whole(self._agent.worker_start(group)[1])
        if now != started.expected:
            return self._drop(
                started, f"the sealed round's environment differs in {_differing(now, started.expected)}"
            )
        pids = started.context.pids()
        gone = [pid for pid in pids.values() if not pid_alive(pid)]
        if gone:
            return self._drop(started, f"prepared worker pid(s) {gone} exited before the seal")
        self._agent.process_context = started.context
        self._agent.events.emit(
            "round",
            f"round {started.round}: the {len(pids)} prepared worker(s) are the round's "
            f"(started {time.time() - started.at:.2f}s before the seal)",
            round=started.round,
            prepared_kept=True,
            pids=sorted(pids.values()),
        )
        return pids

    def discard(self, why: str) -> None:
        """Stop the prepared workers, if any (a round that will not be theirs, the agent's end)."""
        started, self._started = self._started, None
        if started is not None:
            self._drop(started, why)

    def _drop(self, started: _Started, why: str) -> None:
        """Stop ``started`` and say why (returns None: what :meth:`take` returns then)."""
        started.context.close(timeout=STOP_LIMIT_S)
        if self._pool is not None:  # what they took: the round about to start its workers takes them warming
            self._pool.fill(self._agent.get_worker_group().spec.local_world_size, low_priority=False)
        message = f"prepared workers of round {started.round} stopped: {why}; the round starts its workers"
        log.warning("%s", message)
        self._agent.events.emit("round", message, round=started.round, prepared=False, fallback=why)


def _differing(a: dict[int, dict[str, str]], b: dict[int, dict[str, str]]) -> list[str]:
    """The variables whose values differ between two sets of per-rank environments."""
    ranks = set(a) | set(b)
    names = {k for rank in ranks for k in set(a.get(rank, {})) | set(b.get(rank, {}))}
    return sorted(k for k in names if any(a.get(r, {}).get(k) != b.get(r, {}).get(k) for r in ranks))
