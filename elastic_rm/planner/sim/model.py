"""What the simulator tracks: injected faults and costs, node slices, jobs (plain mutable records)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..config import PlannerConfig
from ..state import PlannerState
from .trace import TraceJob
from .truth import Step


@dataclass(frozen=True)
class Instability:
    """Injected faults, per node-hour, and costs shared by every policy."""

    fail_per_node_h: float = 0.004
    straggler_per_node_h: float = 0.01
    straggler_slowdown: tuple[float, float] = (1.5, 4.0)
    straggler_mean_h: float = 3.0
    throttle_share: float = 0.5  # stragglers that show a hardware signal (GPU throttling)
    restart_s: float = 60.0  # pause of every round, any policy
    ckpt_interval_s: float = 600.0  # progress lost on a crash: uniform up to this much training
    max_restarts: int = 3  # worker crashes (OOM) tolerated, torchrun --max-restarts


def sim_planner_config() -> PlannerConfig:
    """The planner thresholds the simulator runs with (ticks are 60 s, samples every 120 s)."""
    return PlannerConfig(
        sample_interval_s=120.0,
        profile_window_s=360.0,
        cooldown_s=600.0,
        straggler_enter=2,
        straggler_exit=2,
        resize_rounds=True,
        standby_max=0,
    )


@dataclass
class SimNode:
    id: str
    arrival: int
    machine: int
    cpu: float
    mem: float
    gpus: int
    seen_at: float
    fail_at: float
    strag_at: float
    strag_until: float
    strag_factor: float
    strag_throttle: bool

    def slowdown(self, now: float) -> float:
        return self.strag_factor if self.strag_at <= now < self.strag_until else 1.0


@dataclass
class SimJob:
    trace: TraceJob
    rng: np.random.Generator
    policy: object = None
    pstate: PlannerState = field(default_factory=PlannerState)
    nodes: dict[str, SimNode] = field(default_factory=dict)
    members: list[str] = field(default_factory=list)
    standby: list[str] = field(default_factory=list)
    round: int = -1
    decided_at: float = 0.0
    pause_until: float = 0.0
    progress: float = 0.0
    status: str = "queued"
    start_s: float = math.nan
    end_s: float = math.nan
    ooms: int = 0
    rounds: int = 0
    reason: str = ""
    usage: list[float] = field(
        default_factory=lambda: [0.0] * 6
    )  # cpu alloc/used, mem alloc/used, gpu alloc/busy
    last_tp: float = 0.0
    last_cpu: float = 0.0
    round_mem: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # t0, mem0, t, mem (per node)
    peak_cpu: float = 0.0
    decisions: list[str] = field(default_factory=list)
    round_lost: bool = False  # a member died; the round is broken until the policy writes a new one
    last_members: list[str] = field(default_factory=list)  # the round as written (incl. the dead)
    step: Step | None = None  # the latest simulated step (what the agents would report)
    queued_behind_lent_s: float = 0.0  # node-seconds other jobs held past their request while this one queued
    peak_lent: int = 0  # the most nodes this job held past its request
    started_short: bool = False  # its first start had fewer nodes than its start size
    called_in: bool = False  # it gave its nodes back to a later job once (Simulator, "call-in")
    round_started: float = 0.0  # when the current round's (or restart's) first step ran
    node_s: float = 0.0  # node-seconds held (members, standby and nodes not yet released)
