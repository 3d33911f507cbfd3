"""The worker channel's wire format: a worker (:mod:`elastic_rm.train.report`) and its node's agent
(:mod:`elastic_rm.agent.channel`) over a Unix datagram socket and a memory-mapped control file.

Struct-packed, little endian, no pickle. Every datagram starts with :data:`HEADER`; a ``KIND_STEPS``
datagram carries :data:`STEPS` followed by n doubles (wall seconds per step, oldest first), then n doubles
(busy seconds); a ``KIND_ACK`` datagram carries :data:`ACK`. The agent writes :data:`CONTROL` to the
control file; workers read it at each flush.
"""

from __future__ import annotations

import signal
import struct

ENV_AGENT_DIR = "ELASTIC_RM_AGENT_DIR"
ENV_ROUND = "ERM_ROUND"  # the round id a worker started in or was moved into (rounds in place)
# set (to the round id) for a worker started before its round was sealed (elastic_rm/agent/prepared.py):
# rank 0's store listens only after the kept nodes drained, so it waits longer for it
ENV_PREPARED = "ERM_PREPARED_ROUND"
SOCKET_NAME = "agent.sock"
CONTROL_NAME = "control"

MAGIC = 0xE7A1
VERSION = 3  # 2: each step carries its busy time next to its wall time; 3: restores carry the step before
KIND_HELLO, KIND_STEPS, KIND_ACK, KIND_BYE = 1, 2, 3, 4
ACK_OK, ACK_HOOK_FAILED = 0, 1
HEADER = struct.Struct("<HBBiii")  # magic, version, kind, pid, rank, local_rank
STEPS = struct.Struct("<qqI4x")  # completed steps after this batch, samples in the batch, n steps
ACK = struct.Struct("<qB7x")  # last completed step, status
CONTROL = struct.Struct("<HBxIQ")  # magic, version, drain (0/1), drain sequence number

# ---- rounds in place (elastic_rm.train.rounds, elastic_rm.agent.inplace) ------------------------------
# Worker -> agent (after HEADER): KIND_INPLACE says "this process stays across rounds"; its body is
# STACKS_BODY when the worker prints its stacks on STACKS_SIGNAL (below), else empty;
# KIND_RESUMED carries RESUMED once the worker trained its first step of a round it joined in place;
# KIND_FAILED carries RESUMED then UTF-8 text (at most MAX_TEXT bytes): why its re-init failed.
KIND_INPLACE, KIND_RESUMED, KIND_FAILED = 5, 6, 7
# KIND_LOST carries RESUMED then UTF-8 text: this worker's round failed (a collective, e.g. a peer was lost);
# its process groups are destroyed and it waits in place for the agent's next round message.
KIND_LOST = 9
RESUMED = struct.Struct("<q")  # the round id
MAX_TEXT = 2048
# Agent -> worker: on this signal a worker of rounds in place prints every thread's stack to its stderr
# (faulthandler, from the signal handler: it works while a collective blocks) and carries on. The agent
# sends it to a worker that did not hold its failed round in time, before restarting it: its log then
# says where the worker waited. Only to a worker whose KIND_INPLACE said so, as a script may handle the
# signal itself. A real-time signal, not SIGUSR1 or SIGUSR2: Slurm sends those before a job's time limit
# (`--signal`), and training frameworks handle them to requeue the job.
STACKS_SIGNAL = signal.SIGRTMIN + 4
STACKS_BODY = b"stacks"

# ---- restores (elastic_rm.train.report, elastic_rm.agent.restores) ----------------------------------------
# Worker -> agent, once after the first step that follows a restore: RESTORED_HEAD, then UTF-8 JSON
# {file: source} (at most MAX_TEXT bytes; "{}" when it would not fit): where this rank read each file.
KIND_RESTORED = 8
# round id, restored (global) step, world saved at, world now, load s, then this process's newest step
# before the restore (-1: a new process, it trained none) and that step's end (unix seconds)
RESTORED_HEAD = struct.Struct("<qqiidqd")

# Agent -> worker: a file ``round-<pid>`` in the channel directory (written whole, then renamed) holding
# ROUND and then the new environment as UTF-8 "KEY=VALUE" entries separated by NUL bytes.
ROUND_FILE = "round-{pid}"
ROUND = struct.Struct("<HBBIq")  # magic, version, action, payload bytes, round id
ROUND_JOIN, ROUND_LEAVE = 1, 2
ROUND_FAIL = 3  # to a worker waiting after its round failed: no new round came; fail as it would have
ROUND_ACTIONS = (ROUND_JOIN, ROUND_LEAVE, ROUND_FAIL)


def encode_round(action: int, round_id: int, env: dict[str, str]) -> bytes:
    """The agent's message to one in-place worker: join ``round_id`` with ``env``, leave (exit 0), or fail."""
    if action not in ROUND_ACTIONS:
        raise ValueError(f"round action must be ROUND_JOIN, ROUND_LEAVE or ROUND_FAIL, got {action!r}")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key or "\0" in value:
            raise ValueError(f"environment entry {key!r} cannot be sent (empty, '=' or NUL in it)")
    payload = "\0".join(f"{k}={v}" for k, v in sorted(env.items())).encode()
    return ROUND.pack(MAGIC, VERSION, action, len(payload), round_id) + payload


def decode_round(data: bytes) -> tuple[int, int, dict[str, str]]:
    """(action, round id, environment) of a round message; ValueError when it is not one."""
    if len(data) < ROUND.size:
        raise ValueError(f"round message of {len(data)} bytes is shorter than its header")
    magic, version, action, size, round_id = ROUND.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise ValueError(
            f"round message with magic {magic:#x} version {version} (mixed elastic-rm versions?)"
        )
    if action not in ROUND_ACTIONS or len(data) != ROUND.size + size:
        raise ValueError(f"round message with action {action} and {len(data)} bytes is malformed")
    text = data[ROUND.size :].decode()
    env = dict(entry.split("=", 1) for entry in text.split("\0")) if text else {}
    return action, round_id, env
