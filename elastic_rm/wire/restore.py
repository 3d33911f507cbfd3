"""The restore report a worker sends its agent over the worker channel (:mod:`elastic_rm.wire.channel`,
``KIND_RESTORED``): struct-packed numbers, then where each checkpoint file was read from as JSON text."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .channel import MAX_TEXT, RESTORED_HEAD


@dataclass(frozen=True)
class Restored:
    round_id: int
    step: int  # the global step restored
    world_before: int  # ranks that saved the checkpoint
    world_after: int  # ranks that loaded it
    load_s: float
    sources: dict[str, str]  # file -> source it was read from on this rank ({} when it did not fit)
    # this process's newest step before the restore and its end (unix s); None: a new process. A worker
    # that stays across rounds knows it exactly, its agent only up to the last batch of step times it got
    step_before: tuple[int, float] | None = None


def encode_restored(
    round_id: int,
    step: int,
    world_before: int,
    world_after: int,
    sources: dict[str, str],
    load_s: float,
    step_before: tuple[int, float] | None = None,
) -> bytes:
    """The body of a ``KIND_RESTORED`` datagram (after the header)."""
    text = json.dumps(dict(sorted(sources.items())), separators=(",", ":")).encode()
    if len(text) > MAX_TEXT:
        text = b"{}"  # a rank that read very many files: the numbers still go
    load = float(load_s) if math.isfinite(load_s) and load_s >= 0 else 0.0
    before, before_at = step_before if step_before is not None else (-1, 0.0)
    return RESTORED_HEAD.pack(round_id, step, world_before, world_after, load, before, before_at) + text


def decode_restored(body: bytes) -> Restored:
    """ValueError when ``body`` is not a restore report."""
    if len(body) < RESTORED_HEAD.size or len(body) > RESTORED_HEAD.size + MAX_TEXT:
        raise ValueError(f"restore report of {len(body)} bytes is malformed")
    round_id, step, before, after, load_s, step_before, before_at = RESTORED_HEAD.unpack_from(body)
    if step < 0 or before < 1 or after < 1 or not (math.isfinite(load_s) and load_s >= 0):
        raise ValueError(f"restore report with step {step}, worlds {before}->{after}, load {load_s}")
    if step_before < -1 or (step_before >= 0 and not (math.isfinite(before_at) and before_at > 0)):
        raise ValueError(f"restore report with step before {step_before} ended at {before_at}")
    try:
        sources = json.loads(bytes(body[RESTORED_HEAD.size :]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ValueError(f"restore report sources are not JSON ({exc})") from None
    if not isinstance(sources, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in sources.items()
    ):
        raise ValueError("restore report sources must map file names to source names")
    newest = (step_before, before_at) if step_before >= 0 else None
    return Restored(round_id, step, before, after, load_s, sources, newest)
