"""The `erm demo` scenario, one method per phase: an embedded etcd and two nodes training the example DLRM
under the planner (world 2); a third node the planner admits (scale-up); a fourth as the standby and a
member throttled through its cgroup until the planner replaces it (straggler; needs a writable cgroup);
a member SIGKILLed with its node memory (failure); then the job stopped and the summary written.

The caller watches through two callbacks (every poll of the progress lines, every event) and prints;
everything the scenario starts is stopped in `teardown`, also after a timeout or Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from ..agent import cgroup as cg
from ..checkpoint.node_memory import remove_node_memory, run_memory_dir
from ..etcd.server import EtcdServer
from .checks import checks
from .harness import DEFAULT_JOB, DEFAULT_SCRIPT, Demo, new_workdir
from .readers import decisions_from_etcd, outcomes_from_etcd, rounds_from_etcd
from .summary import restarted_at, summarize, world_reached

POLL_S = 0.25  # how often the progress lines are read while waiting or holding
THROTTLED_CPU = 0.1  # cores left to the straggler (its cgroup's quota)


class Scenario:
    def __init__(
        self,
        workdir: str | None = None,
        phase_timeout: float = 120.0,
        hold_s: float = 8.0,
        on_rows: Callable[[list[dict]], None] = lambda rows: None,
        on_event: Callable[[str], None] = lambda text: None,
    ):
        self.workdir = workdir or new_workdir()
        self.phase_timeout = phase_timeout
        self.hold_s = hold_s
        self.on_rows = on_rows
        self.on_event = on_event
        self.phase = "starting"
        self.t_begin = time.time()
        self.layout = cg.detect()
        agent_args = ["--job", DEFAULT_JOB]
        if self.layout is not None:  # each node in a cgroup of its own (no quota yet), so one can be slowed
            agent_args += ["--cpu-limit", str(os.cpu_count() or 1)]
        # the workers keep their processes across planned rounds (docs/train.md, "Rounds in place")
        self.demo = Demo(
            self.workdir, DEFAULT_SCRIPT, script_args=["--in-place"], nnodes="2:3", agent_args=agent_args
        )
        self.etcd: EtcdServer | None = None
        self.throttled: cg.NodeCgroup | None = None
        self.rounds: list[dict] = []
        self.timeline: str | None = None  # the PNG written by `finish`, when matplotlib is there
        self.results_file: Path | None = None  # <workdir>/demo.json, written by `finish`

    # -- waiting and telling ----------------------------------------------------------------------------

    def say(self, kind: str, text: str) -> None:
        self.demo.event(kind, text)
        self.on_event(text)

    def wait_for(self, predicate: Callable[[list[dict]], object], what: str):
        """Poll the progress lines until `predicate` returns something true (returned), or time out with
        what the leader decided meanwhile and the machine's load (a busy machine makes a member measure
        slow: the planner may then replace a straggler where the scenario waits for a scale-up)."""
        started = time.time()
        deadline = started + self.phase_timeout
        while time.time() < deadline:
            rows = self.demo.progress()
            self.on_rows(rows)
            value = predicate(rows)
            if value:
                return value
            time.sleep(POLL_S)
        raise TimeoutError(
            f"{what} did not happen within {self.phase_timeout:.0f}s{self._instead(started)}; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} core(s) (the demo expects an otherwise idle "
            f"machine); logs in {self.workdir}"
        )

    def _instead(self, since: float) -> str:
        """The leader's decisions since `since`, as a clause of the timeout's message ('' when none or
        when etcd cannot be read)."""
        try:
            found = [d for d in decisions_from_etcd(self.endpoint, self.demo.run_id) if d["t"] >= since]
        except Exception:  # noqa: BLE001 - the timeout is the error to report, not a failed read
            return ""
        if not found:
            return "; the leader decided nothing meanwhile"
        return "; the leader decided instead: " + " | ".join(
            f"round {d['round']}: {d['reason']}" for d in found
        )

    def hold(self) -> None:
        """Let the job train for `hold_s` in the current phase, watched."""
        end = time.time() + self.hold_s
        while time.time() < end:
            self.on_rows(self.demo.progress())
            time.sleep(POLL_S)

    def decided(self, since: float, words: str) -> Callable[[list[dict]], list[dict]]:
        """A predicate: the leader's decisions since `since` whose reason contains `words`."""
        endpoint = self.endpoint
        return lambda _rows: [
            d
            for d in decisions_from_etcd(endpoint, self.demo.run_id)
            if d["t"] >= since and words in d["reason"]
        ]

    @property
    def endpoint(self) -> str:
        if self.etcd is None:
            raise RuntimeError("the scenario's etcd is not started: call setup() first")
        return self.etcd.endpoint

    # -- phases -----------------------------------------------------------------------------------------

    def setup(self) -> None:
        os.makedirs(self.workdir, exist_ok=True)
        # a reused workdir: an old run's progress (and its stop file) would end this one at once
        shutil.rmtree(os.path.join(self.workdir, "progress"), ignore_errors=True)
        shutil.rmtree(os.path.join(self.workdir, "ckpt"), ignore_errors=True)
        self.etcd = EtcdServer().start()
        self.say("etcd", f"embedded etcd at {self.endpoint}; run {self.demo.run_id}; workdir {self.workdir}")

    def train_at_two(self) -> None:
        self.phase = "world 2"
        for name in ("node-a", "node-b"):
            self.demo.start_node(name, self.endpoint)
        t0 = time.time()
        self.wait_for(lambda rows: world_reached(rows, 2, t0), "training at world 2")
        self.say("round", "training at world 2 (the planner's cold start for the job's request)")
        self.hold()

    def scale_up(self) -> None:
        self.phase = "scale-up"
        t_up = time.time()
        self.demo.start_node("node-c", self.endpoint)
        self.say(
            "node", "node-c arrives: the planner profiles world 2, then decides whether a third node pays"
        )
        d = self.wait_for(self.decided(t_up, "scale up"), "the planner's scale-up decision")[0]
        self.say("decision", f"round {d['round']}: {d['reason']}")
        self.wait_for(lambda rows: world_reached(rows, 3, t_up), "training at world 3")
        self.say("round", f"training at world 3, {time.time() - t_up:.1f}s after node-c started")
        self.hold()

    def straggler(self) -> None:
        if self.layout is None:
            self.say("skip", "no writable cgroup here (needs root): the straggler phase is skipped")
            return
        self.phase = "straggler"
        self.demo.start_node("node-d", self.endpoint)
        self.say("node", "node-d arrives and waits as a standby")
        self.hold()
        # node-b, unless the planner took a node back meanwhile (it measured a loss) and node-b left:
        # then another member of the world as it is now, not the leader (its planner would slow down too)
        members = rounds_from_etcd(self.endpoint, self.demo.run_id)[-1]["members"]
        victim = "node-b" if "node-b" in members else next(m for m in reversed(members) if m != "node-a")
        self.throttled = cg.NodeCgroup(self.layout, f"{self.demo.run_id}.{victim}")
        self.throttled.set_cpu(THROTTLED_CPU)
        t_slow = time.time()
        self.say("fault", f"{victim} throttled to {THROTTLED_CPU} CPU (its cgroup's quota): a straggler")
        d = self.wait_for(self.decided(t_slow, "straggler"), "the straggler's replacement")[0]
        self.say(
            "decision", f"round {d['round']}: {d['reason']} ({time.time() - t_slow:.1f}s after the throttle)"
        )
        world = len(d["members"])
        self.wait_for(lambda rows: restarted_at(rows, world, d["t"]), f"training again at world {world}")
        self.hold()

    def failure(self) -> None:
        self.phase = "failure"
        members = rounds_from_etcd(self.endpoint, self.demo.run_id)[-1]["members"]
        victim = members[-1]  # a member: its loss needs a new round
        node = self.demo.nodes[victim]
        node.signal(signal.SIGKILL)
        node.killed = t_kill = time.time()
        remove_node_memory(self.demo.run_id, victim)  # a dead machine's memory is gone with it
        self.say("fault", f"{victim} killed with SIGKILL (and its node memory removed)")
        d = self.wait_for(self.decided(t_kill, "lost"), "the round after the loss")[0]
        world = len(d["members"])  # the survivors, and a standby when they are below the minimum
        self.wait_for(lambda rows: restarted_at(rows, world, t_kill), f"training again at world {world}")
        self.say("round", f"training again at world {world}, {time.time() - t_kill:.1f}s after the kill")
        self.hold()

    def stop_job(self) -> None:
        """Ask the workers to stop (the example's stop file), wait for the nodes, read the rounds etcd
        recorded with the leader's predicted and measured gain of each."""
        self.phase = "stopping"
        open(os.path.join(self.demo.progress_dir, "stop"), "w").close()
        self.say("stop", "asking the job to stop")
        for name, node in self.demo.nodes.items():
            if node.killed is None:
                try:
                    node.proc.wait(self.phase_timeout)
                except Exception:  # noqa: BLE001 - teardown ends it
                    self.say("stop", f"{name} did not exit in time; stopping it")
        self.rounds = rounds_from_etcd(self.endpoint, self.demo.run_id)
        outcomes = outcomes_from_etcd(self.endpoint, self.demo.run_id)
        for r in self.rounds:
            o = outcomes.get(r.get("round"), {})
            r["predicted_gain"], r["measured_gain"] = o.get("predicted_gain"), o.get("measured_gain")

    def teardown(self) -> None:
        """Stop everything the scenario started (idempotent): the throttle, the nodes, etcd, node memory."""
        if self.throttled is not None and self.throttled.cpu_dir.exists():  # gone when its node exited
            self.throttled.set_cpu(None)
        self.demo.stop_all()
        if self.etcd is not None:
            self.etcd.stop()
        shutil.rmtree(run_memory_dir(self.demo.run_id), ignore_errors=True)  # the killed node's copies too

    def finish(self) -> dict:
        """The summary from the progress lines and the rounds: throughput, downtime, restores, checks;
        written to summary.json with a timeline PNG beside it."""
        rows = self.demo.progress()
        summary = summarize(rows, self.rounds)
        summary["checks"] = checks(rows)
        summary["events"] = self.demo.events
        summary["wall_s"] = time.time() - self.t_begin
        self.write_results(summary)
        try:
            from ..obs.timeline import plot_demo

            self.timeline = plot_demo(rows, self.demo.events, os.path.join(self.workdir, "timeline.png"))
        except ImportError:
            pass
        return summary

    def write_results(self, summary: dict) -> None:
        """The run's figures in the workdir: summary.json, and demo.json with the figures README quotes
        (`results_file`; ``python -m benchmarks.demo`` copies it into benchmarks/results/)."""
        from ..obs.results_file import write_demo_results

        with open(os.path.join(self.workdir, "summary.json"), "w") as fh:
            json.dump(summary, fh, indent=2)
        self.results_file = write_demo_results(summary, Path(self.workdir))

    # -- the whole scenario -----------------------------------------------------------------------------

    def run(self) -> dict:
        """Every phase in order, then the summary; TimeoutError or KeyboardInterrupt after the teardown."""
        try:
            self.setup()
            self.train_at_two()
            self.scale_up()
            self.straggler()
            self.failure()
            self.stop_job()
        finally:
            self.teardown()
        return self.finish()


def passed(summary: dict) -> bool:
    """The demo's verdict: it trained at worlds 2 and 3 and every exactly-once check held."""
    return {2, 3} <= set(summary["throughput"]) and all(c["ok"] for c in summary["checks"])
