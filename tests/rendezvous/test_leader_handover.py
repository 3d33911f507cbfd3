"""A leader that writes a round leaving itself out hands the leadership to a member (real etcd, three
handlers): the member that takes over seals the round, the node left out (a swapped straggler, a
node scaled away) does not campaign while a member leads, and leads once every member has left. Also the
outcome that travels in the round record, so that whichever leader holds a round measures it."""

from __future__ import annotations

import threading
import time

import pytest

from elastic_rm.planner.interface import Decision, Wait
from elastic_rm.planner.membership import MembershipPolicy
from elastic_rm.rendezvous import leader as leader_mod
from elastic_rm.rendezvous.outcome import BEFORE, OUTCOME_WINDOW_S, PendingOutcome
from elastic_rm.wire.records import RoundRecord

from .test_handler import join_all, make, wait_for


class LeaveTheLeaderOut(MembershipPolicy):
    """Once the round has three members, the node this policy runs on (the leader) leaves itself out
    (the other RoundPolicy hooks: membership's)."""

    def __init__(self, me: str) -> None:
        self.me = me

    def decide(self, snapshot):
        r = snapshot.current
        if r is not None and len(r.members) == 3 and self.me in r.members:
            others = tuple(m for m in r.members if m != self.me)
            return Decision(others, (self.me,), "test: the leader leaves itself out")
        return Wait("nothing to change")


def test_a_leader_that_leaves_itself_out_hands_over_to_a_member_which_seals_the_round(etcd, run_id):
    hs = [make(etcd, run_id, 2, 3) for _ in range(3)]
    waiting: list[threading.Thread] = []
    try:
        join_all(hs)
        assert wait_for(lambda: sum(h._leader.leading for h in hs) == 1)
        old = next(h for h in hs if h._leader.leading)
        for h in hs:
            h._leader._policy = LeaveTheLeaderOut(h.node_id)
        results: dict[str, object] = {}

        def rejoin(h):
            try:
                results[h.node_id] = h.next_rendezvous()
            except Exception as exc:  # noqa: BLE001 - the node left out waits until it is shut down
                results[h.node_id] = exc

        for h in hs:  # as agents do when their round changes: each calls next_rendezvous again
            waiting.append(threading.Thread(target=rejoin, args=(h,), daemon=True))
            waiting[-1].start()
        members = {h.node_id for h in hs if h is not old}
        assert wait_for(lambda: members <= set(results), timeout=20), results
        sealed = hs[0].view.round
        assert sealed is not None and sealed.sealed and set(sealed.members) == members
        assert sealed.leader == old.node_id  # it decided the round ...
        new = [h for h in hs if h._leader.leading]
        assert len(new) == 1 and new[0].node_id in members  # ... and a member sealed it
        assert not old._leader.leading
        time.sleep(leader_mod.LEADERLESS_GRACE_S + 0.5)  # the node left out still does not campaign
        assert [h.node_id for h in hs if h._leader.leading] == [new[0].node_id]
        assert old.node_id not in results  # it waits as standby
        for h in hs:  # every member leaves (their leases revoked): the node left out must lead now
            if h is not old:
                h.release()
        assert wait_for(lambda: old._leader.leading, timeout=10)
    finally:
        for h in hs:
            h.shutdown()
        for t in waiting:
            t.join(10)


def test_the_outcome_pending_for_a_round_is_read_from_its_record_and_measured_after_a_window():
    r = RoundRecord(4, ("a", "b"), predicted_gain=0.25, extra={BEFORE: 1000.0})
    pending = PendingOutcome.of(r)
    assert pending is not None and (pending.round, pending.before) == (4, 1000.0)
    assert pending.measured(r, 1100.0, [], now=100.0) is None  # the window starts now
    assert pending.measured(r, None, [], now=101.0) is None  # a member without steps: it starts again
    assert pending.measured(r, 1100.0, [], now=102.0) is None
    out = pending.measured(r, 1100.0, [1.0], now=102.0 + OUTCOME_WINDOW_S)
    assert out is not None and round(out["measured_gain"], 6) == 0.1
    assert round(out["prediction_error"], 6) == 0.15 and out["coef"] == [1.0]
    assert PendingOutcome.of(RoundRecord(1, ("a",))) is None  # the first round: nothing decided before it
    assert PendingOutcome.of(RoundRecord(2, ("a",), extra={BEFORE: None})).before is None
    assert PendingOutcome.of(RoundRecord(2, ("a",), extra={BEFORE: True})).before is None  # not a number


@pytest.mark.parametrize("before", [int("9" * 400), float("nan"), float("inf")])
def test_a_throughput_before_that_is_no_finite_number_is_unknown(before):
    """A new leader reads the pending outcome on every step: a 400-digit integer (json.loads reads one)
    raised OverflowError there, and a NaN became an outcome record with a NaN gain."""
    r = RoundRecord(2, ("a",), predicted_gain=0.1, extra={BEFORE: before})
    pending = PendingOutcome.of(r)
    assert pending is not None and pending.before is None
    assert pending.measured(r, 1100.0, [], now=0.0) is None
    out = pending.measured(r, 1100.0, [], now=OUTCOME_WINDOW_S)
    assert out is not None and out["measured_gain"] is None and out["prediction_error"] is None


def test_a_node_that_handed_over_waits_the_grace_though_it_campaigned_long_before(etcd, run_id):
    """The grace before a node left out campaigns counts from its hand-over. It once counted from the
    first time the node saw the run without a leader (its own first campaign, long before), so a straggler
    that had led since the start campaigned at once after handing over, and on a loaded machine won the
    leadership back from the members (tests/e2e/test_inplace_rounds.py failed so)."""
    from dataclasses import replace

    h = make(etcd, run_id, 1, 1)
    try:
        join_all([h])
        lead = h._leader
        assert wait_for(lambda: lead.leading)
        lead.stop()  # the test drives the leader's steps from here on
        time.sleep(leader_mod.LEADERLESS_GRACE_S + 0.2)  # its first campaign is now longer ago than the grace
        r = h.view.round
        assert r is not None
        lead._hand_over(replace(r, round=r.round + 1, members=("another-node",)))
        assert wait_for(lambda: h.view.leader is None)
        wait_until = lead._campaign_after()
        assert wait_until is not None and wait_until > time.monotonic()  # it waits for a member to lead
        lead._step()
        assert not lead.leading and h.view.leader is None
    finally:
        h.shutdown()
