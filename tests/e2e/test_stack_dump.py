"""`kill -USR1 <ermrun>` prints every thread's stack and the agent carries on (docs/operate.md): how to see
where an agent that does not exit waits."""

from __future__ import annotations

import signal
import time

from tests.e2e.helpers import ermrun, steps_at_world, wait_until


def test_sigusr1_prints_the_agents_stacks_and_the_job_goes_on(tmp_path, procs):
    node = ermrun(tmp_path, "a", ["--standalone", "--nproc-per-node", "1", "--spares", "off"])
    procs.append(node)
    wait_until(lambda: steps_at_world(tmp_path, "a", 1) > 3, 120, "the node training", [node])
    node.popen.send_signal(signal.SIGUSR1)  # the agent only (its workers run in sessions of their own)
    wait_until(lambda: "_invoke_run" in node.output(), 30, "the stack dump", [node])
    out = node.output()
    assert "Thread 0x" in out and "launch_agent" in out and node.popen.poll() is None  # dumped, still running
    t = time.time()
    wait_until(lambda: steps_at_world(tmp_path, "a", 1, since=t) > 3, 60, "training after the dump", [node])
    (tmp_path / "stop").touch()
    assert node.wait(60) == 0, node.output()[-3000:]
