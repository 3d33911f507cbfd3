"""Baseline policies for the simulator: the user's static configuration and an Optimus-style planner.

Optimus-style (Peng et al., EuroSys'18, as re-read in reference §2.2): an online NNLS fit of the sync
speed model ``T = a*B/w + b + c*w`` with no prior, so it explores (one probe per new world size) until it
has three distinct sizes, then greedily moves to the marginal-gain optimum. No warm start, no straggler or
OOM handling, no resizing: nodes keep the user's per-node resources. Liveness is the membership rules.
"""

from __future__ import annotations

from dataclasses import replace

from .config import PlannerConfig
from .interface import ClusterSnapshot, Decision, Wait
from .membership import MembershipPolicy, eligible_nodes
from .nnls import dot, nnls
from .state import Advice, PlannerState, observe


class StaticPolicy(MembershipPolicy):
    """The user's configuration: membership only (the simulator sets MIN = MAX = requested nodes)."""


def optimus_fit(samples: list[tuple[int, float]], batch: float) -> list[float] | None:
    """NNLS coefficients of T(w) = a*B/w + b + c*w from (world, step time), None if < 3 sizes."""
    if len({w for w, _ in samples}) < 3:
        return None
    coef, _ = nnls([[batch / w, 1.0, float(w)] for w, _ in samples], [t for _, t in samples])
    return coef


class OptimusPolicy:
    """Fitted model + greedy marginal gain; explores upward by one step per configuration first."""

    def __init__(self, config: PlannerConfig | None = None) -> None:
        self.config = config or PlannerConfig()
        self.state = PlannerState()

    def decide(self, snapshot: ClusterSnapshot) -> Decision | Wait:
        answer, self.state = self.step(snapshot, self.state)
        return answer

    def wanted_nodes(self) -> tuple[int, str] | None:
        """RoundPolicy: the node count of its last advice (the simulator resizes to it), or None."""
        a = self.state.advice
        return (a.target_nodes, a.reason) if a.target_nodes > 0 else None

    def model_coef(self) -> tuple[float, ...]:
        """RoundPolicy: its coefficients are of another model than the planner's, so none are recorded."""
        return ()

    @property
    def flagged(self) -> frozenset[str]:
        """RoundPolicy: Optimus-style handles no stragglers."""
        return frozenset()

    def adopt_flagged(self, nodes: frozenset[str]) -> None:
        """RoundPolicy: Optimus-style handles no stragglers."""

    def step(self, snapshot: ClusterSnapshot, state: PlannerState) -> tuple[Decision | Wait, PlannerState]:
        cfg = self.config
        state = observe(snapshot, state, cfg.sample_interval_s, cfg.window, float("inf"), clean_apart=False)
        cur = snapshot.current
        base = MembershipPolicy().decide(snapshot)
        nodes = eligible_nodes(snapshot)
        alive = {n.node_id for n in nodes}
        if cur is None or not cur.members or any(m not in alive for m in cur.members):
            if isinstance(base, Decision):
                state = replace(state, last_round_at=snapshot.now, decided_on_round=cur.number if cur else -1)
            return base, state
        if state.decided_on_round == cur.number:
            return Wait("decided, not yet written"), state
        if snapshot.now < state.last_round_at + cfg.cooldown_s:
            return Wait("cooldown", until=state.last_round_at + cfg.cooldown_s), state
        ready = [c for c in state.configs if c.round == cur.number]
        if snapshot.now - state.round_seen_at < cfg.profile_window_s or len(ready) < cfg.min_profile_samples:
            return Wait("profiling"), state
        w = len(cur.members)
        batch = float(snapshot.job.get("global_batch", 1))
        coef = optimus_fit([(c.world, c.step_s) for c in state.configs], batch)
        lo, hi = max(snapshot.min_nodes, 1), snapshot.max_nodes
        if coef is None:
            target = w + max(1, w // 4) if w < hi else w - 1
            why = "exploring"
        else:
            tp = {k: batch / max(dot(coef, (batch / k, 1.0, float(k))), 1e-9) for k in range(lo, hi + 1)}
            target = lo
            while (
                target + 1 <= hi
                and tp[target + 1] - tp[target] >= cfg.min_marginal_gain * tp[target] / target
            ):
                target += 1
            why = "greedy marginal gain"
        target = min(max(target, lo, w - cfg.max_step), hi, w + cfg.max_step)
        if target in state.probed and coef is None:
            target = w
        state = replace(state, advice=Advice(target_nodes=target, reason=why))
        waiting = [n.node_id for n in nodes if n.node_id not in set(cur.members)]
        target = min(target, w + len(waiting))
        if target == w:
            return Wait(f"optimus: staying at {w}"), state
        members = list(cur.members)[:target] + waiting[: max(target - w, 0)]
        state = replace(state, last_round_at=snapshot.now, decided_on_round=cur.number)
        return Decision(tuple(members), (), f"optimus: {why} {w} -> {target}"), state
