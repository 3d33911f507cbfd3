"""Probe-loss benchmark: how often packet loss alone takes a healthy node out of the run (a false
step-out of the peer probe, elastic_rm/rendezvous/peer_probe.py), against the previous rule.

Three hosts (network namespaces, tests/netns/hosts.py) with random loss on every link, each way; h1 and h2
listen where a checkpoint server would, h0 probes them with the peer probe's own connects
(``probe_outcomes``), at the previous connect timeout (0.5 s) and at ``CONNECT_TIMEOUT_S``, one after the
other. The measured probes are then replayed at the agent's cadence (each probe's measured duration, then
``PROBE_INTERVAL_S``) through two clocks, h0 ranked last in the round (so a tie may take it out too):

- naive, the previous rule (``EveryProbeClock``): the cut-off rule checked on each probe's count of failed
  peers, held at every probe for the window; any peers, as long as enough fail each time;
- per peer, the current one (``CutOffClock``): a peer counts only once every probe of it failed for the
  window.

A false step-out is a verdict on a network where every host is up and reachable. Last, a real cut
(both peers' routes to h0 blackholed: h0's connects get no answer) checks that the clocks still take h0
out, and how long that takes from the cut. Writes benchmarks/results/probe-loss.json.

Run (root, ``ip netns``): ``python -m benchmarks.probe_loss --loss 0.05 0.10 --probes 1000``.
"""

from __future__ import annotations

from collections.abc import Iterable

from elastic_rm.rendezvous.peer_probe import PROBE_INTERVAL_S
from elastic_rm.rendezvous.peer_quorum import TIE_WINDOWS, CutOffClock, cut_off

PREVIOUS_TIMEOUT_S = 0.5


class EveryProbeClock:
    """The previous rule, kept here as the baseline: ``cut_off`` on each probe's count, held at every probe
    for the window (two windows for a tie); one probe below the rule resets it."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._since: float | None = None

    def observe(
        self, now: float, probed: Iterable[str], lost: set[str], earlier: set[str] = frozenset()
    ) -> set[str]:
        peers = len(list(probed))
        if not cut_off(peers, len(lost), bool(lost & earlier)):
            self._since = None
            return set()
        if self._since is None:
            self._since = now
        windows = 1 if cut_off(peers, len(lost)) else TIE_WINDOWS
        return set(lost) if now - self._since >= windows * self.window_s else set()

    def reset(self) -> None:
        self._since = None


CLOCKS = {"naive": EveryProbeClock, "per_peer": CutOffClock}


def replay(
    probes: list[dict], peers: list[str], earlier: set[str], clock, interval_s: float = PROBE_INTERVAL_S
) -> dict:
    """Feed measured probes (``duration_s``, ``lost``) to ``clock`` at the agent's cadence: the verdicts
    (step-outs; the clock starts afresh after each, as the rejoined node's would) and the time replayed."""
    now, step_outs, first_at = 0.0, 0, None
    for row in probes:
        now += row["duration_s"]
        if clock.observe(now, peers, set(row["lost"]), earlier):
            step_outs += 1
            first_at = round(now, 2) if first_at is None else first_at
            clock.reset()
        now += interval_s
    return {"step_outs": step_outs, "replayed_s": round(now, 1), "first_step_out_s": first_at}
