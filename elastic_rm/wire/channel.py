"""The worker channel's wire format: a worker (:mod:`elastic_rm.train.report`) and its node's agent
(:mod:`elastic_rm.agent.channel`) over a Unix datagram socket and a memory-mapped control file.

Struct-packed, little endian, no pickle. Every datagram starts with :data:`HEADER`; a ``KIND_STEPS``
datagram carries :data:`STEPS` followed by n doubles (wall seconds per step, oldest first), then n doubles
(busy seconds); a ``KIND_ACK`` datagram carries :data:`ACK`. The agent writes :data:`CONTROL` to the
control file; workers read it at each flush.
"""

from __future__ import annotations

import struct

ENV_AGENT_DIR = "ELASTIC_RM_AGENT_DIR"
SOCKET_NAME = "agent.sock"
CONTROL_NAME = "control"

MAGIC = 0xE7A1
VERSION = 2  # 2: each step carries its busy time next to its wall time
KIND_HELLO, KIND_STEPS, KIND_ACK, KIND_BYE = 1, 2, 3, 4
ACK_OK, ACK_HOOK_FAILED = 0, 1
HEADER = struct.Struct("<HBBiii")  # magic, version, kind, pid, rank, local_rank
STEPS = struct.Struct("<qqI4x")  # completed steps after this batch, samples in the batch, n steps
ACK = struct.Struct("<qB7x")  # last completed step, status
CONTROL = struct.Struct("<HBxIQ")  # magic, version, drain (0/1), drain sequence number
