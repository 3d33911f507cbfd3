"""When a node counts as cut off from its round: the quorum rules of the peer probe, pure.

A node steps out of the run (elastic_rm.rendezvous.peer_probe) when more than half of at least 2 of its
probed peers fail every probe of them for the window. A tie has no majority: two members that cannot reach
each other (a round of two), or a node that cannot reach exactly half of its peers (in a round of three,
the link between two of them cut). Both sides see the same, so a deterministic rule decides: the node
steps out when one of the peers it cannot reach comes before it in the round's member list (a lower group
rank); the earlier one stays. Of two hosts cut apart, group rank 1 leaves and group rank 0 trains on
alone. A tie must hold for ``TIE_WINDOWS`` windows: when a node is cut off from all its peers, each of them
sees a tie against it, and the cut-off node (a majority after one window) must have left first (its peers
then no longer count it: it is gone from etcd).
"""

from __future__ import annotations

from collections.abc import Iterable

TIE_WINDOWS = 2  # a tie steps a node out after this many windows (a majority after one)
MAJORITY_PROBES, TIE_PROBES = 2, 3  # failed probes in a row, at least, before a peer counts (CutOffClock)


def cut_off(peers: int, unreachable: int, outranked: bool = False) -> bool:
    """The rule: more than half of at least 2 peers unreachable; or a tie (exactly half, one peer of one
    included) when ``outranked``: an unreachable peer has a lower group rank than this node."""
    if unreachable <= 0:
        return False
    if peers >= 2 and 2 * unreachable > peers:
        return True
    return outranked and 2 * unreachable >= peers


def holds_back(peers: int, unreachable: int) -> bool:
    """Whether a node that stepped out must wait before rejoining: it does not reach more than half of the
    run's other live nodes (a tie included: rejoining then would only lead to the same tie again)."""
    return unreachable > 0 and 2 * unreachable >= peers


def outranked(members: tuple[str, ...] | list[str], node: str, unreachable: set[str]) -> bool:
    """Whether one of the ``unreachable`` peers comes before ``node`` in the round's ``members``."""
    return bool(unreachable & ranked_before(members, node))


def ranked_before(members: tuple[str, ...] | list[str], node: str) -> set[str]:
    """The members before ``node`` in the round's list (none when it is not a member: no rank to compare)."""
    return set(members[: members.index(node)]) if node in members else set()


class CutOffClock:
    """Since when each probed peer has failed every probe of it; pure (the caller passes the time).

    Why per peer: under packet loss any one connect fails now and then, and a rule checked on each probe's
    count alone would take a node out when different peers fail in turn (two of two peers failing one
    probe or another for the whole window). A peer counts as unreachable once every probe of it failed for the
    window, ``MAJORITY_PROBES`` probes at least; for a tie, two windows and ``TIE_PROBES`` probes."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._silent: dict[str, tuple[float, int]] = {}  # peer -> (its first failed probe in a row, how many)

    def observe(
        self, now: float, probed: Iterable[str], lost: set[str], earlier: set[str] = frozenset()
    ) -> set[str]:
        """Record a probe of ``probed`` (``lost``: those that failed); return the peers that take this node
        out (``cut_off``, a tie when one of them is ``earlier`` in the round), else an empty set."""
        probed = list(probed)
        self._silent = {n: self._failed_again(n, now) for n in probed if n in lost}
        return self.verdict(now, len(probed), earlier)

    def verdict(self, now: float, peers: int, earlier: set[str] = frozenset()) -> set[str]:
        silent = self._silent_for(now, 1, MAJORITY_PROBES)
        if cut_off(peers, len(silent)):
            return silent
        tied = self._silent_for(now, TIE_WINDOWS, TIE_PROBES)
        return tied if cut_off(peers, len(tied), bool(tied & earlier)) else set()

    def reset(self) -> None:
        self._silent = {}

    def _failed_again(self, peer: str, now: float) -> tuple[float, int]:
        since, failed = self._silent.get(peer, (now, 0))
        return since, failed + 1

    def _silent_for(self, now: float, windows: int, probes: int) -> set[str]:
        return {
            n
            for n, (since, failed) in self._silent.items()
            if failed >= probes and now - since >= windows * self.window_s
        }
