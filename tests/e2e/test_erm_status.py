"""Operating a live job: `erm status --json` matches the truth in etcd and explains its decisions, `erm top`
renders in an 80-column terminal and follows changes, the event log (file, etcd, ermrun's output), a
malformed record is reported and not fatal, the report of the run names each decision.

One job for the module (it takes most of the time): node a starts alone (round 1, world 1), node b joins
(round 2, world 2: a is drained at a step boundary); it stays live for every test, in any order. The end
of a job (the workers see a stop file) is a one-node job of its own.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs.events import EventLog
from elastic_rm.wire.keyspace import Keyspace
from launcher.erm import main as erm_main
from tests.conftest import BIN, REPO, Proc
from tests.e2e.helpers import exit_code_after, records, wait_until
from tests.ermrun_argv import ermrun_argv, node_args

REPORTING = os.path.join(REPO, "tests", "workers", "reporting.py")
ERM = os.path.join(BIN, "erm")


@dataclass
class Job:
    run_id: str
    endpoint: str
    dir: Path
    procs: dict[str, Proc]

    def events_file(self, node: str) -> Path:
        return self.dir / f"{node}.events.jsonl"

    def file_events(self, node: str) -> list[dict]:
        return [json.loads(line) for line in self.events_file(node).read_text().splitlines()]


def erm(*args: str) -> subprocess.CompletedProcess:
    """`erm ARGS` in this process (the same code as the command; a subprocess would spend seconds
    importing torch on every call)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = erm_main(list(args))
    return subprocess.CompletedProcess(["erm", *args], code, out.getvalue(), err.getvalue())


def status(job: Job) -> dict:
    out = erm("status", "--endpoint", job.endpoint, "--run-id", job.run_id, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def follow_events(endpoint: str, run_id: str) -> subprocess.Popen:
    """``erm events --follow`` of the run, its output in pipes (faulthandler on: a hang shows its stacks)."""
    return subprocess.Popen(
        [ERM, "events", "--endpoint", endpoint, "--run-id", run_id, "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONFAULTHANDLER="1"),
    )


def start_node(endpoint: str, run_id: str, tmp: Path, name: str, *extra: str) -> Proc:
    """A node of the job: ermrun with the reporting worker, which stops when ``tmp/stop`` exists."""
    argv = ermrun_argv(
        *node_args(endpoint, run_id, "1:2", name, conf="lease_ttl=2"),
        *extra,
        REPORTING,
        event_log=tmp / f"{name}.events.jsonl",
        event_sample_interval=1,
    )
    return Proc(argv, str(tmp / f"{name}.log"), env={"STEPS_DIR": str(tmp), "STEPS_NODE": name})


@pytest.fixture(scope="module")
def job(etcd, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("job")
    run_id = f"t-{uuid.uuid4().hex[:10]}"
    procs: dict[str, Proc] = {}

    def start(name: str, *extra: str) -> Proc:
        procs[name] = start_node(etcd.endpoint, run_id, tmp, name, *extra)
        return procs[name]

    j = Job(run_id, etcd.endpoint, tmp, procs)
    try:
        start("a")

        def a_measured_alone() -> bool:
            path = j.events_file("a")
            return (
                path.exists()
                and sum(
                    e["kind"] == "sample" and e["data"]["samples_per_s"] is not None
                    for e in j.file_events("a")
                )
                >= 2
            )

        wait_until(a_measured_alone, 120, "node a training alone, sampled", procs.values())
        start("b", "--log-format", "json")
        wait_until(
            lambda: all(any(r.get("world") == 2 and "step" in r for r in records(tmp, n)) for n in "ab"),
            120,
            "both nodes training at world 2",
            procs.values(),
        )
        wait_until(
            lambda: status(j)["decisions"][-1]["measured_gain"] is not None,
            60,
            "samples of round 2 from both nodes",
            procs.values(),
        )
        yield j
    finally:
        for p in procs.values():
            p.stop()


def test_status_json_matches_etcd_and_explains_decisions(job):
    out = subprocess.run(
        [ERM, "status", "--endpoint", job.endpoint, "--run-id", job.run_id, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    s = json.loads(out.stdout)
    with EtcdClient(job.endpoint) as c:
        truth = json.loads(c.get(f"/elastic-rm/{job.run_id}/round").value)
        leader = c.get(f"/elastic-rm/{job.run_id}/leader").value.decode()
    assert s["round"] == truth["round"] and s["sealed"] and s["world_size"] == 2
    assert [m["node"] for m in s["members"]] == truth["members"] == ["a", "b"] and s["leader"] == leader
    assert all(m["state"] == "active" and m["step_p50_s"] > 0 for m in s["members"])
    first, last = s["decisions"][0], s["decisions"][-1]
    assert (first["members"], last["members"], last["round"]) == (["a"], ["a", "b"], truth["round"])
    assert all(d["reason"] for d in s["decisions"]) and last["reason"] == truth["reason"]
    assert last["predicted_gain"] is None  # the membership policy predicts nothing
    assert last["compared_to_round"] < last["round"] and last["throughput_before"] > 0
    assert last["measured_gain"] == pytest.approx(last["throughput_after"] / last["throughput_before"] - 1)
    assert "outcome record" in s["measured_how"] and last["prediction_error"] is None  # nothing predicted
    # the recent events: the newest 8 (decisions may have scrolled out behind drains, restores, node notes)
    assert "round" in {e["kind"] for e in s["events"]} and len(s["events"]) <= 8
    assert all(e["node"] and e["message"] and e["time"] > 0 for e in s["events"])


def test_status_shows_each_nodes_own_memory_not_the_machines(job):
    """Two nodes share this machine: each reports its agent's and workers' resident memory."""
    s = status(job)
    for m in s["members"]:
        agent = psutil.Process(job.procs[m["node"]].pid)
        workers = [p for p in agent.children(recursive=True) if "guard.py" not in " ".join(p.cmdline())]
        rss = sum(p.memory_info().rss for p in [agent, *workers])
        assert 0.5 * rss <= m["mem_node_bytes"] <= 2 * rss, (m, rss)
        assert m["mem_node_bytes"] < m["mem_used_bytes"]  # the machine's used memory holds both nodes


ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[()][A-Za-z0-9]")


def test_top_renders_in_80_columns_and_follows_etcd(job):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 80, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    env["PYTHONFAULTHANDLER"] = "1"  # a hang at exit shows its stacks (exit_code_after)
    p = subprocess.Popen(
        [ERM, "top", "--endpoint", job.endpoint, "--run-id", job.run_id],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    screen = b""

    def read_more(wait_s: float) -> bytes | None:
        """What the terminal has within ``wait_s`` (b"": nothing yet); None once it is closed."""
        if not select.select([master], [], [], wait_s)[0]:
            return b""
        try:
            return os.read(master, 65536)
        except OSError:
            return None

    def read_until(needle: str, timeout: float = 60) -> str:
        nonlocal screen
        deadline = time.monotonic() + timeout
        while needle not in ANSI.sub("", screen.decode(errors="replace")):
            assert time.monotonic() < deadline, f"{needle!r} not shown:\n{screen.decode(errors='replace')}"
            chunk = read_more(0.5)
            if chunk is None:
                break
            screen += chunk
        return ANSI.sub("", screen.decode(errors="replace"))

    def rest_of_screen() -> str:
        """What it wrote in the next 5 s (its stacks, once made to dump them)."""
        out = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (chunk := read_more(0.5)):
            out += chunk
        return out.decode(errors="replace")

    try:
        text = read_until("recent events")
        assert f"run {job.run_id}" in text and "decisions" in text and "samples/s" in text
        # a change in etcd shows up without polling: an event written now
        marker = f"probe-{uuid.uuid4().hex[:6]}"
        with EtcdClient(job.endpoint) as c:
            log = EventLog(job.run_id, "tester", client=c, keys=Keyspace("/elastic-rm", job.run_id))
            log.emit("node", marker)
            assert log.flush()
        text = read_until(marker)
        lines = [line for chunk in text.split("\n") for line in chunk.split("\r")]
        assert max(len(line.rstrip()) for line in lines) <= 80, max(lines, key=len)
        p.send_signal(signal.SIGINT)
        assert exit_code_after(p, 30, stderr=rest_of_screen) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        os.close(master)


def test_event_log_in_files_etcd_and_ermrun_output(job):
    a, b = job.file_events("a"), job.file_events("b")
    started = next(e for e in a if e["kind"] == "job")  # the handler's "leader" may come first
    assert started["data"]["status"] == "started" and started["node"] == "a"
    kinds = {e["kind"] for e in a}
    assert {"leader", "decision", "round", "drain", "sample"} <= kinds  # a led, joined, was drained
    drained = [e for e in a if e["kind"] == "drain"]
    assert drained[0]["data"]["acked"] == 1 and drained[0]["data"]["steps"][0] > 0
    assert any(e["kind"] == "round" and e["data"] == {"round": 2, "rank": 1, "world": 2} for e in b)
    out = erm("events", "--endpoint", job.endpoint, "--run-id", job.run_id, "--json")
    assert out.returncode == 0, out.stderr
    from_etcd = [json.loads(line) for line in out.stdout.splitlines()]
    assert {"a", "b"} <= {e["node"] for e in from_etcd} and "sample" not in {e["kind"] for e in from_etcd}
    assert [e["time"] for e in from_etcd] == sorted(e["time"] for e in from_etcd)
    text = erm("events", "--file", str(job.events_file("a")), "--kind", "drain")
    assert text.returncode == 0 and "drained 1 worker(s) at step" in text.stdout
    assert len(text.stdout.splitlines()) == len(drained)
    # ermrun's own output: one line per event (text) and JSON lines (b runs with --log-format json)
    assert re.search(r"\[ermrun\] \d\d:\d\d:\d\d drain +drained 1 worker", job.procs["a"].output())
    printed = [
        json.loads(line) for line in job.procs["b"].output().splitlines() if line.startswith('{"data"')
    ]
    assert any(e["kind"] == "round" and e["node"] == "b" for e in printed)


def test_malformed_records_are_reported_not_fatal(job):
    keys = Keyspace("/elastic-rm", job.run_id)
    broken = [
        (keys.metric("zz"), b"{broken"),
        (keys.events + "00000000000000000001-zz-000000", b'{"v": 1, "kind": "nope"}'),
    ]
    with EtcdClient(job.endpoint) as c:
        for key, value in broken:
            c.put(key, value)
        try:
            s = status(job)
            assert any("metrics/zz" in e for e in s["errors"]) and s["world_size"] == 2
            assert any("00000000000000000001-zz-000000" in e for e in s["errors"])
            out = erm("events", "--endpoint", job.endpoint, "--run-id", job.run_id)
            assert (
                out.returncode == 0 and "malformed" in out.stderr and "00000000000000000001-zz" in out.stderr
            )
            assert "decision" in out.stdout
            text = erm("status", "--endpoint", job.endpoint, "--run-id", job.run_id)
            assert text.returncode == 0 and "malformed" in text.stdout and "metrics/zz" in text.stdout
        finally:  # the module's job, as the tests after this one (in any order) expect it
            for key, _ in broken:
                c.delete(key)


def test_report_of_the_live_run_names_each_decision(job, tmp_path):
    files = [a for n in "ab" for a in ("--events", str(job.events_file(n)))]
    out = erm("report", job.run_id, "--endpoint", job.endpoint, *files, "-o", str(tmp_path))
    assert out.returncode == 0, out.stderr
    decisions = status(job)["decisions"]
    assert f"{len(decisions)} decision(s)" in out.stdout
    page = (tmp_path / f"{job.run_id}.html").read_text()
    for d in decisions:
        assert f"<tr><td>{d['round']}</td>" in page and d["reason"] in page
    assert (tmp_path / f"{job.run_id}.png").read_bytes()[:4] == b"\x89PNG"


def test_job_end_is_logged_and_status_says_closed(etcd, run_id, tmp_path, procs):
    """A job of its own: the module's job stays live for the tests that run after this one, in any order."""
    p = start_node(etcd.endpoint, run_id, tmp_path, "c")
    procs.append(p)
    job = Job(run_id, etcd.endpoint, tmp_path, {"c": p})
    wait_until(lambda: any("step" in r for r in records(tmp_path, "c")), 120, "node c training", [p])
    (tmp_path / "stop").touch()
    assert p.wait(120) == 0, p.output()[-3000:]
    last = job.file_events("c")[-1]
    assert (last["kind"], last["data"]["status"]) == ("job", "succeeded")
    assert status(job)["closed"]


def test_erm_events_follow_prints_new_events_as_they_come(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as c:
        log = EventLog(run_id, "n0", client=c, keys=keys)
        log.emit("job", "already there", status="started")
        assert log.flush()
        p = follow_events(etcd.endpoint, run_id)
        try:
            assert "already there" in p.stdout.readline()  # printed before the watch starts
            log.emit("failure", "rank 1 exited 7", ranks=[1], exit_codes=[7])
            log.emit("sample", "not shown by default", round=1)
            log.emit("drain", "drained 2 worker(s) at step 40", steps=[40])
            new = {tuple(p.stdout.readline().split(None, 4)[2:]) for _ in range(2)}  # etcd's order
            assert new == {
                ("n0", "failure", "rank 1 exited 7\n"),
                ("n0", "drain", "drained 2 worker(s) at step 40\n"),
            }
            p.send_signal(signal.SIGINT)
            assert exit_code_after(p, 30) == 0
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def test_status_shows_the_mirrored_sample_ledger(etcd, run_id):
    """The `data:` line and `data` key come from `<run>/ledger` (what the leader mirrors at each checkpoint);
    a malformed value is reported, not fatal."""
    from elastic_rm.agent.ledger_mirror import ledger_record
    from elastic_rm.train.ledger import GlobalBatches, RangeLedger

    batches = GlobalBatches(RangeLedger(1000, 100), 50)
    for _ in range(23):  # 2 epochs and 150 samples
        batches.next()
        batches.consumed()
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as c:
        c.put(keys.ledger, ledger_record(23, "a", batches.ledger.checkpoint_state()).to_json())
        s = json.loads(erm("status", "--endpoint", etcd.endpoint, "--run-id", run_id, "--json").stdout)
        assert {k: s["data"][k] for k in ("step", "epoch", "samples_done", "epoch_samples", "by")} == {
            "step": 23,
            "epoch": 1,
            "samples_done": 1150,
            "epoch_samples": 1000,
            "by": "a",
        }
        text = erm("status", "--endpoint", etcd.endpoint, "--run-id", run_id).stdout
        expected = "data: 1,150 samples trained (epoch 1: 150 of 1,000), as of the checkpoint of step 23"
        assert expected in " ".join(text.split())  # the console may wrap it
        c.put(keys.ledger, b'{"v": 1, "step": "x"}')
        s = json.loads(erm("status", "--endpoint", etcd.endpoint, "--run-id", run_id, "--json").stdout)
    assert s["data"] is None and any(keys.ledger in e for e in s["errors"])


def test_erm_events_follow_ends_when_the_run_is_closed_and_every_node_left(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as c:
        log = EventLog(run_id, "n0", client=c, keys=keys)
        log.emit("job", "started", status="started")
        assert log.flush()
        c.put(keys.nodes + "n0", b"{}")  # a node still in the run
        p = follow_events(etcd.endpoint, run_id)
        try:
            assert "started" in p.stdout.readline()
            c.put(keys.closed, json.dumps({"by": "erm stop"}).encode())
            log.emit("job", "node n0: job stopped by erm stop", status="stopped by erm stop")
            assert log.flush()
            assert p.poll() is None  # closed, but a node is still there: its last events may come
            c.delete(keys.nodes + "n0")
            assert exit_code_after(p, 30) == 0
            assert "job stopped by erm stop" in p.stdout.read()  # written before the node left
            assert "closed and every node left" in p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(10)


def _catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt"))
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_piped_top_stopped_by_sigterm_prints_its_last_frame(etcd, run_id):
    keys = Keyspace("/elastic-rm", run_id)
    with EtcdClient(etcd.endpoint) as c:
        log = EventLog(run_id, "n0", client=c, keys=keys)
        log.emit("job", "started on n0", status="started")
        assert log.flush()
        p = subprocess.Popen(
            [ERM, "top", "--endpoint", etcd.endpoint, "--run-id", run_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONFAULTHANDLER="1"),
        )
        try:
            wait_until(lambda: p.poll() is not None or _catches_sigterm(p.pid), 60, "erm top's live view")
            p.send_signal(signal.SIGTERM)
            assert exit_code_after(p, 30) == 0
            out = p.stdout.read()
            assert f"run {run_id}" in out and "started on n0" in out, out
        finally:
            if p.poll() is None:
                p.kill()
            p.wait(10)
