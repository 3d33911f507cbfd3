"""JobView owns its state: this node's own writes reach it through its transition methods only, and the
watch stays the authority (a transition never undoes a later change the watch delivered). Real etcd."""

from __future__ import annotations

import ast
import threading
import time
from pathlib import Path

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.rendezvous.view import JobView
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import ClosedRecord
from tests.rendezvous.test_handler import wait_for

ROOT = Path(__file__).resolve().parents[2]


def _view(etcd, run_id):
    client = EtcdClient(etcd.endpoint, timeout=5)
    view = JobView(client, Keyspace("/elastic-rm", run_id))
    view.start()
    return client, view


def test_our_election_does_not_undo_a_later_change_the_watch_delivered(etcd, run_id):
    client, view = _view(etcd, run_id)
    try:
        rev = client.put(view.keys.leader, "b")
        assert wait_for(lambda: view.leader == "b", timeout=10)
        version = view.membership_version
        view.note_leadership("a", rev - 1)  # an election older than what the watch saw: ignored
        assert (view.leader, view.membership_version) == ("b", version)
        view.note_leadership("a", rev + 10)  # ahead of the watch: applied at once
        assert (view.leader, view.leader_rev) == ("a", rev + 10) and view.membership_version == version + 1
    finally:
        view.stop()
        client.close()


def test_closed_keeps_the_first_record_and_waiters_wake(etcd, run_id):
    client, view = _view(etcd, run_id)
    try:
        seen = view.version
        woke: list[int] = []

        def waiter() -> None:
            woke.append(view.wait(seen, timeout=600))

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()
        time.sleep(0.2)  # the waiter is likely asleep in wait() by now; if not, it sees the change at once
        first, second = ClosedRecord(by="n0", time=1.0), ClosedRecord(by="n1", time=2.0)
        view.note_closed(first)
        thread.join(120)
        assert woke and woke[0] > seen  # a change woke the waiter: its timeout would have kept it 600 s
        view.note_closed(second)
        assert view.closed == first and view.version > seen

        thread = threading.Thread(target=waiter)
        seen = view.version
        thread.start()
        time.sleep(0.2)
        view.wake_waiters()  # no change, but a stopping thread must not sleep out its timeout
        thread.join(5)
        assert len(woke) == 2 and woke[1] < 5 and view.version == seen
    finally:
        view.stop()
        client.close()


def test_no_module_outside_the_view_assigns_its_fields():
    """The fields of a JobView (``view.x``, ``self._view.x``) are assigned in view.py only."""
    offenders = []
    for path in sorted((ROOT / "elastic_rm").rglob("*.py")):
        if path.name == "view.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = node.targets if isinstance(node, ast.Assign) else []
            if isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    owner = t.value if isinstance(t, ast.Attribute) else None
                    name = owner.id if isinstance(owner, ast.Name) else None
                    name = owner.attr if isinstance(owner, ast.Attribute) else name
                    if name in ("view", "_view"):
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"JobView fields assigned outside view.py: {offenders}"


def test_following_members_that_failed_part_way_is_completed_by_the_next_call(etcd, run_id):
    """A new leader whose etcd call failed while it set up its watches (a timeout under load, a partition)
    used to stay marked as tracking with no watch of the acks: no round could ever be sealed."""
    from elastic_rm.etcd.errors import EtcdTimeoutError

    client, view = _view(etcd, run_id)
    read = client.get_prefix

    def flaky(prefix, *args, **kwargs):
        if prefix == view.keys.rounds:
            raise EtcdTimeoutError("etcd did not answer (injected)")
        return read(prefix, *args, **kwargs)

    try:
        client.get_prefix = flaky  # type: ignore[method-assign]
        try:
            view.track_members()
            raise AssertionError("the injected timeout did not reach the caller")
        except EtcdTimeoutError:
            pass
        assert not view.tracking
        client.get_prefix = read  # type: ignore[method-assign]
        watches = len(view._cancels)
        view.track_members()
        assert view.tracking and len(view._cancels) == watches + 1  # the acks' watch, not a second nodes'
        client.put(view.keys.ack(1, "n0"), b'{"v":1,"node":"n0"}')
        client.put(
            view.keys.node("n0"),
            b'{"v":1,"node":"n0","host":"h","addr":"a","pid":1,"nproc":1,"state":"joining"}',
        )
        assert wait_for(lambda: "n0" in view.acks.get(1, {}) and "n0" in view.nodes)
    finally:
        view.stop()
        client.close()
