"""A worker that does not hold its failed round in time is restarted after a loss; before that the agent
makes it print its threads' stacks, so that its log says where it waited. Real worker process, real
channel: the stacks come from the worker's signal handler while its main thread blocks in a call."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.agent.inplace import InPlaceRounds
from elastic_rm.obs.events import EventLog
from elastic_rm.wire.channel import ENV_AGENT_DIR
from tests.agent.test_inplace_hold import REPO, one_rank  # noqa: F401 - a fixture

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stuck_worker.py")


def wait_until(predicate, limit: float, what: str) -> None:
    deadline = time.monotonic() + limit
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_worker_that_did_not_hold_prints_where_it_waits_and_other_processes_get_no_signal(
    tmp_path,
    one_rank,  # noqa: F811
):
    stderr_path = tmp_path / "stderr"
    with AgentChannel(str(tmp_path / "ch")) as channel, open(stderr_path, "wb") as stderr:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        env = {**os.environ, ENV_AGENT_DIR: channel.directory, "PYTHONPATH": REPO}
        proc = subprocess.Popen([sys.executable, WORKER], env=env, stdout=subprocess.PIPE, stderr=stderr)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert proc.stdout.readline() == b"blocked\n"
            wait_until(lambda: agent.show_stacks([proc.pid]) == [proc.pid], 30, "the worker opting in")
            wait_until(lambda: b"wait_for_the_dead_peer" in stderr_path.read_bytes(), 30, "its stacks")
            assert agent.show_stacks([other.pid]) == []  # it did not opt in: SIGUSR1 would end it
            assert proc.poll() is None and other.poll() is None  # both carry on
            assert agent.waiting_s([proc.pid]) is None  # it never held a failed round
        finally:
            for p in (proc, other):
                p.kill()
                p.wait()
    dump = stderr_path.read_text()
    assert "stuck_worker.py" in dump and " in wait_for_the_dead_peer" in dump, dump  # where it waits


def test_a_worker_whose_script_handles_the_signal_itself_is_never_sent_it(
    tmp_path,
    one_rank,  # noqa: F811
):
    with AgentChannel(str(tmp_path / "ch")) as channel:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        opted_in = threading.Event()
        agent.on_capable = opted_in.set
        env = {**os.environ, ENV_AGENT_DIR: channel.directory, "PYTHONPATH": REPO}
        proc = subprocess.Popen([sys.executable, WORKER, "own-handler"], env=env, stdout=subprocess.PIPE)
        try:
            assert proc.stdout.readline() == b"blocked\n"
            assert opted_in.wait(30), "the worker never said it stays in place"
            assert agent.show_stacks([proc.pid]) == []  # its own SIGUSR1 handler is not the agent's to call
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait()
        assert b"own handler ran" not in proc.stdout.read()
