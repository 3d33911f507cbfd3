"""A malformed value is listed as malformed and never stops an observation command (docs/operate.md):
times no clock can format, outcome records and sample events of the wrong shape; and the commands' edges:
``--decisions 0``, a run id that is not there, a reader that leaves (``| head -1``)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.obs import events as ev
from elastic_rm.obs.events import Event
from elastic_rm.obs.status import outcome_problem, status_from_kvs
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import NodeRecord, RoundRecord
from launcher.erm import main as erm_main
from tests.conftest import BIN, REPO
from tests.obs import recorded_run
from tests.planner.helpers import JOB

ERM = os.path.join(BIN, "erm")
PREFIX = "/elastic-rm"


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    """`erm status`' text view one line per malformed value (rich folds lines at its console's width)."""
    monkeypatch.setenv("COLUMNS", "400")


def erm(*args: str) -> subprocess.CompletedProcess:
    """`erm ARGS` in this process (as tests/e2e/test_erm_status.py does: no seconds of imports per call)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = erm_main(list(args))
    return subprocess.CompletedProcess(["erm", *args], code, out.getvalue(), err.getvalue())


def erm_within(timeout: float, *args: str) -> subprocess.CompletedProcess:
    """erm(ARGS) on a thread of its own, failing when it has not returned within ``timeout`` seconds (a
    command that waits for a run forever); in this process, as erm() is, without a torch import each."""
    done: list[subprocess.CompletedProcess | BaseException] = []

    def call() -> None:
        try:
            done.append(erm(*args))
        except BaseException as exc:  # noqa: B036 - raised again on the test's thread
            done.append(exc)

    thread = threading.Thread(target=call, name=f"erm {args[0]}", daemon=True)
    thread.start()
    thread.join(timeout)
    assert done, f"erm {' '.join(args)} still runs {timeout:g} s later"
    if isinstance(done[0], BaseException):
        raise done[0]
    return done[0]


def recorded(etcd, run_id: str, tmp_path) -> tuple[Keyspace, str]:
    """The recorded run (3 decisions, outcomes of rounds 2 and 3) in etcd and in a file."""
    keys = Keyspace(PREFIX, run_id)
    path = str(tmp_path / "n0.events.jsonl")
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        recorded_run.write(c, keys, path)
    return keys, path


def event_json(run_id: str, kind: str, t: float, **data) -> str:
    body = {
        "v": 1,
        "time": t,
        "run": run_id,
        "node": "n9",
        "kind": kind,
        "message": f"{kind} m",
        "data": data,
    }
    return json.dumps(body)


# -- 1. times out of range ------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1e300, -1e20, -1, 253_402_300_800])
def test_an_event_time_no_clock_can_format_is_malformed(t):
    with pytest.raises(ev.EventError, match="field 'time'") as info:
        Event.parse("src:3", event_json("r", "job", t))
    assert str(info.value).startswith("src:3")
    assert Event.parse("src:4", event_json("r", "job", 1_764_500_000.5)).time == 1_764_500_000.5


def test_status_events_and_report_list_an_out_of_range_time_and_go_on(etcd, run_id, tmp_path):
    keys, _ = recorded(etcd, run_id, tmp_path)
    bad_event = f"{keys.events}99999999999999999999-n9-000000"
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        c.put(bad_event, event_json(run_id, "failure", 1e300))
        record = RoundRecord(4, ("n0",), reason="far future", leader="n0", sealed=True, time=1e300)
        c.put(keys.record(4), record.to_json())
    common = ("--endpoint", etcd.endpoint, "--run-id", run_id)
    out = erm("status", *common)  # the text view: it formats each decision's and event's time
    assert out.returncode == 0, out.stderr
    assert f"malformed: etcd key {bad_event}: field 'time'" in out.stdout
    assert "rounds/00000004/record" in out.stdout and "far future" not in out.stdout
    assert "node n2 lost" in out.stdout  # the other decisions are still there
    shown = json.loads(erm("status", *common, "--json").stdout)
    assert [d["round"] for d in shown["decisions"]] == [1, 2, 3]
    assert any("rounds/00000004/record" in m and "'time'" in m for m in shown["errors"])
    out = erm("events", *common)
    assert out.returncode == 0, out.stderr
    assert "restored step 780" in out.stdout and f"malformed: etcd key {bad_event}" in out.stderr
    out = erm("report", run_id, "--endpoint", etcd.endpoint, "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "3 decision(s)" in out.stdout
    assert bad_event in out.stderr and "rounds/00000004/record" in out.stderr


def test_event_files_with_an_out_of_range_time_are_read_and_the_line_listed(run_id, tmp_path):
    path = tmp_path / "n9.events.jsonl"
    good = [e.to_json() for e in recorded_run.events(run_id)]
    path.write_text("\n".join([good[0], event_json(run_id, "failure", -1e20), *good[1:]]) + "\n")
    out = erm("events", "--file", str(path))
    assert out.returncode == 0, out.stderr
    assert f"malformed: {path}:2: field 'time'" in out.stderr and "node n2 lost" in out.stdout
    out = erm("report", run_id, "--events", str(path), "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert f"malformed (skipped): {path}:2" in out.stderr and "3 decision(s)" in out.stdout


# -- 2. outcome records of the wrong shape -------------------------------------------------------------

BAD_OUTCOMES = [
    ({"measured_gain": "x"}, "'measured_gain'"),
    ({"measured_gain": [0.3]}, "'measured_gain'"),
    ({"measured_gain": 0.5, "throughput_before": None}, "without the 'throughput_before'"),
    ({"throughput_after": {"a": 1}}, "'throughput_after'"),
    ({"prediction_error": True}, "'prediction_error'"),
]


@pytest.mark.parametrize("change, message", BAD_OUTCOMES)
def test_outcome_problem_names_the_field(change, message):
    good = recorded_run.outcome(2)
    assert outcome_problem(good) is None and outcome_problem({**good, "measured_gain": None}) is None
    assert message in (outcome_problem({**good, **change}) or "")


@pytest.mark.parametrize("change, message", BAD_OUTCOMES[:3])
def test_a_malformed_outcome_record_is_listed_by_status_and_report(etcd, run_id, tmp_path, change, message):
    keys, _ = recorded(etcd, run_id, tmp_path)
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        c.put(keys.outcome(2), json.dumps({**recorded_run.outcome(2), **change}))
    out = erm("status", "--endpoint", etcd.endpoint, "--run-id", run_id)
    assert out.returncode == 0, out.stderr
    assert "rounds/00000002/outcome" in out.stdout and "node n2 lost" in out.stdout
    shown = json.loads(erm("status", "--endpoint", etcd.endpoint, "--run-id", run_id, "--json").stdout)
    by_round = {d["round"]: d for d in shown["decisions"]}
    assert by_round[2]["measured_gain"] is None  # left out: shown as "-"
    assert by_round[3]["measured_gain"] == 950.0 / 1300.0 - 1
    assert any("rounds/00000002/outcome" in m and message in m for m in shown["errors"])
    out = erm("report", run_id, "--endpoint", etcd.endpoint, "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "rounds/00000002/outcome" in out.stderr and "3 decision(s)" in out.stdout


@pytest.mark.parametrize("change, message", BAD_OUTCOMES[:3])
def test_a_malformed_outcome_event_is_listed_by_the_report(run_id, tmp_path, change, message):
    events = recorded_run.events(run_id)
    bad = []
    for e in events:
        if e.kind == "outcome" and e.data["round"] == 2:
            e = Event(e.time, e.run, e.node, e.kind, e.message, {**e.data, **change})
        bad.append(e.to_json())
    path = tmp_path / "n0.events.jsonl"
    path.write_text("\n".join(bad) + "\n")
    out = erm("report", run_id, "--events", str(path), "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "malformed (skipped): outcome event at" in out.stderr and message in out.stderr


# -- 3. a sample's gpu_util ----------------------------------------------------------------------------


@pytest.mark.parametrize("utils", [5, "0.5", {"gpu0": 0.5}, [0.5, "x"]])
def test_a_sample_whose_gpu_util_is_not_a_list_of_numbers_is_malformed(run_id, tmp_path, utils):
    raw = event_json(run_id, "sample", recorded_run.T0 + 50.5, round=2, gpu_util=utils, samples_per_s=1.0)
    with pytest.raises(ev.EventError, match="gpu_util"):
        Event.parse("src:1", raw)
    for fine in ([0.5, None], [], None):
        Event.parse("src:1", event_json(run_id, "sample", recorded_run.T0, gpu_util=fine))
    path = tmp_path / "n9.events.jsonl"
    path.write_text("".join(e.to_json() + "\n" for e in recorded_run.events(run_id)) + raw + "\n")
    out = erm("report", run_id, "--events", str(path), "-o", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert "gpu_util" in out.stderr and "malformed (skipped)" in out.stderr


# -- 4. --decisions 0 -----------------------------------------------------------------------------------


def test_decisions_0_shows_none_and_n_shows_the_last_n(etcd, run_id, tmp_path):
    keys, _ = recorded(etcd, run_id, tmp_path)
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        kvs, revision = c.get_prefix(keys.run)
    shown = {n: status_from_kvs(keys, kvs, revision, decisions=n)["decisions"] for n in (0, 1, 2, 3, 9)}
    assert shown[0] == []
    assert [d["round"] for d in shown[1]] == [3] and [d["round"] for d in shown[2]] == [2, 3]
    assert [d["round"] for d in shown[3]] == [d["round"] for d in shown[9]] == [1, 2, 3]
    assert shown[1][0]["compared_to_round"] == 2  # still measured against the round before it
    out = erm("status", "--endpoint", etcd.endpoint, "--run-id", run_id, "--json", "--decisions", "0")
    assert out.returncode == 0 and json.loads(out.stdout)["decisions"] == []


# -- 5. a run id that is not there ----------------------------------------------------------------------


def test_status_top_and_events_say_there_is_no_such_run_and_show_one_without_rounds(etcd, run_id, tmp_path):
    recorded(etcd, run_id, tmp_path)
    common = ("--endpoint", etcd.endpoint, "--run-id", f"{run_id}-nope")
    for command in (("status",), ("status", "--json"), ("events",)):
        out = erm(*command, *common)
        assert out.returncode == 2, (command, out)
        assert f"no run '{run_id}-nope' under /elastic-rm (runs: " in out.stderr
    for command in (("top",), ("events", "--follow")):  # without the check: they wait for it forever
        done = erm_within(60, *command, *common)
        assert done.returncode == 2 and f"no run '{run_id}-nope'" in done.stderr, (command, done)
    # a run that is there before its first round (a node registered, the leader waiting for its
    # minimum) or without any round key (the recorded run: records and events alone) is shown
    keys = Keyspace(PREFIX, f"{run_id}-early")
    node = NodeRecord("a", "host-a", "127.0.0.1", 1, 1, "joining")
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        c.put(keys.node("a"), json.dumps({"v": 1, **node.__dict__}))
    for run, command in (
        (keys.run_id, ("status", "--json")),
        (keys.run_id, ("events",)),
        (run_id, ("events",)),
    ):
        out = erm(*command, "--endpoint", etcd.endpoint, "--run-id", run)
        assert out.returncode == 0 and not out.stderr, (run, command, out)
    out = erm("status", "--endpoint", etcd.endpoint, "--run-id", keys.run_id, "--json")
    assert json.loads(out.stdout)["standby"][0]["node"] == "a"


# -- 6. a reader that leaves ----------------------------------------------------------------------------


def closed_stdout(argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` writing into a pipe whose reader left before it wrote (as `| head -1` once it has a line)."""
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout is not None
    p.stdout.close()
    _, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, p.returncode, "", err)


# 16 s (five erm processes); CI keeps a closed pipe through erm simulate and erm events --follow
@pytest.mark.slow
def test_status_and_plan_leave_quietly_when_the_reader_left(etcd, run_id, tmp_path):
    recorded(etcd, run_id, tmp_path)
    job = tmp_path / "job.json"
    job.write_text(json.dumps(JOB))
    common = ["--endpoint", etcd.endpoint, "--run-id", run_id]
    for argv in (
        [ERM, "status", *common, "--json"],
        [ERM, "status", *common],
        [ERM, "plan", str(job)],
        [ERM, "plan", str(job), "--json"],
        [ERM, "events", *common],
    ):
        done = closed_stdout(argv)
        assert done.returncode == 1 and done.stderr == "", (argv[1:], done.returncode, done.stderr[-2000:])


def test_events_follow_leaves_when_the_reader_left_while_it_followed(etcd, run_id):
    """The reader leaves while `erm events --follow` waits for new events: the next one, printed on the
    watch's thread, ends the command at once (not when the run ends, which may be days later)."""
    keys = Keyspace(PREFIX, run_id)
    argv = [ERM, "events", "--endpoint", etcd.endpoint, "--run-id", run_id, "--follow"]
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        c.put(f"{keys.events}00000000000000000001-a-000000", b"not json")  # the one thing read before
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert p.stdout is not None and p.stderr is not None
            p.stdout.close()
            assert "malformed" in p.stderr.readline()  # it has read the run: what comes now, the watch has
            deadline = time.monotonic() + 30
            while p.poll() is None and time.monotonic() < deadline:
                c.put(
                    f"{keys.events}{time.time_ns():020d}-a-000000", event_json(run_id, "failure", time.time())
                )
                time.sleep(0.3)
            assert p.poll() == 1, "erm events --follow still runs 30 s after its reader left"
            assert p.communicate(timeout=10)[1] == ""
        finally:
            if p.poll() is None:
                p.kill()
                p.wait(10)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
