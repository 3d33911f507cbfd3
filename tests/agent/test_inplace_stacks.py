"""A worker that does not hold its failed round in time is restarted after a loss; before that the agent
makes it print its threads' stacks, so that its log says where it waited. Real worker process, real
channel: the stacks come from the worker's signal handler while its main thread blocks in a call."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from elastic_rm.agent.channel import AgentChannel, DrainResult
from elastic_rm.agent.inplace import InPlaceRounds
from elastic_rm.obs.events import EventLog
from elastic_rm.wire.channel import ENV_AGENT_DIR
from tests.agent.test_inplace_hold import REPO, one_rank  # noqa: F401 - a fixture

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stuck_worker.py")


def start_worker(channel: AgentChannel, *args: str, stderr=None) -> subprocess.Popen:
    env = {**os.environ, ENV_AGENT_DIR: channel.directory, "PYTHONPATH": REPO}
    proc = subprocess.Popen([sys.executable, WORKER, *args], env=env, stdout=subprocess.PIPE, stderr=stderr)
    assert proc.stdout.readline() == b"blocked\n"
    return proc


def opted_in(agent: InPlaceRounds) -> threading.Event:
    event = threading.Event()
    agent.on_capable = event.set
    return event


def test_a_worker_that_did_not_hold_prints_where_it_waits_before_its_restart(tmp_path, one_rank):  # noqa: F811
    """The restart (torch's SIGTERM to the worker) comes right after show_stacks returns: the stacks
    must be in the log by then, not lost with a signal still pending."""
    stderr_path = tmp_path / "stderr"
    with AgentChannel(str(tmp_path / "ch")) as channel, open(stderr_path, "wb") as stderr:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        ready = opted_in(agent)
        proc = start_worker(channel, stderr=stderr)
        other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert ready.wait(30), "the worker never said it stays in place"
            assert agent.show_stacks([other.pid]) == []  # it did not opt in: the signal would end it
            assert agent.show_stacks([proc.pid]) == [proc.pid]
            proc.send_signal(signal.SIGTERM)  # as the restart does
            assert proc.wait(30) == -signal.SIGTERM
            assert other.poll() is None
            assert agent.waiting_s([proc.pid]) is None  # it never held a failed round
        finally:
            for p in (proc, other):
                p.kill()
                p.wait()
    dump = stderr_path.read_text()
    assert "stuck_worker.py" in dump and " in wait_for_the_dead_peer" in dump, dump  # where it waits


def test_a_worker_whose_script_handles_the_signal_itself_is_never_sent_it(tmp_path, one_rank):  # noqa: F811
    with AgentChannel(str(tmp_path / "ch")) as channel:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        ready = opted_in(agent)
        proc = start_worker(channel, "own-handler")
        try:
            assert ready.wait(30), "the worker never said it stays in place"
            assert agent.show_stacks([proc.pid]) == []  # its own handler is not the agent's to call
            assert proc.poll() is None
        finally:
            proc.kill()
            proc.wait()
        assert b"own handler ran" not in proc.stdout.read()


def later_process_with_pid(old: int) -> subprocess.Popen:
    """A new process given pid ``old`` (ns_last_pid, as root), or the test is skipped."""
    if os.geteuid() != 0 or not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK):
        pytest.skip("choosing the next pid (/proc/sys/kernel/ns_last_pid) needs root")
    for _ in range(5):  # another process may take the pid first: bounded retries
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(old - 1))
        later = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        if later.pid == old:
            return later
        later.kill()
        later.wait()
    pytest.skip(f"pid {old} was not given to the next process in 5 tries")


def killed_worker_pid(channel: AgentChannel, agent: InPlaceRounds) -> int:
    """The pid of a worker that opted in (and prints its stacks), then was killed."""
    ready = opted_in(agent)
    proc = start_worker(channel)
    assert ready.wait(30), "the worker never said it stays in place"
    proc.kill()
    proc.wait()
    return proc.pid


def test_a_later_process_with_a_workers_pid_is_never_sent_the_signal(tmp_path, one_rank):  # noqa: F811
    """pids come round again on a long job: a new worker still importing, with the pid of one that said
    it prints its stacks, would die of the signal."""
    with AgentChannel(str(tmp_path / "ch")) as channel:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        later = later_process_with_pid(killed_worker_pid(channel, agent))
        try:
            assert agent.show_stacks([later.pid]) == []
            assert later.poll() is None
        finally:
            later.kill()
            later.wait()


def test_a_later_process_with_a_workers_pid_has_not_opted_in(tmp_path, one_rank):  # noqa: F811
    """A restarted worker that does not use rounds, given the pid of one that did, must not be taken for
    it: a round in place would wait for it, and a loss would wait for it to hold its failed round."""
    with AgentChannel(str(tmp_path / "ch")) as channel:
        agent = InPlaceRounds(channel, EventLog("run", "node"))
        old = killed_worker_pid(channel, agent)
        clean = DrainResult(acked={old: 0}, failed={}, exited=(), missing=(), unregistered=(), elapsed_s=0.0)
        assert agent.why_not([old], clean) is None  # gone since, it had opted in
        later = later_process_with_pid(old)
        try:
            why = agent.why_not([later.pid], clean)
            assert why == "1 worker(s) do not use elastic_rm.train.rounds", why
        finally:
            later.kill()
            later.wait()
