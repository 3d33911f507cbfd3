"""Worker API <-> agent channel with real worker subprocesses: step times, age-out, drain, no-op path."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from pathlib import Path

import pytest

from elastic_rm.agent.channel import AgentChannel
from elastic_rm.train.report import StepReporter
from elastic_rm.wire.channel import ENV_AGENT_DIR, HEADER, KIND_STEPS, MAGIC, SOCKET_NAME, STEPS, VERSION


def wait_for(pred, timeout_s: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


@pytest.fixture
def channel():
    ch = AgentChannel(window_s=1.0).start()
    try:
        yield ch
    finally:
        ch.close()


def steps_datagram(pid: int, completed: int, samples: int, durs: list[float], busy: list[float]) -> bytes:
    """A STEPS datagram as a worker sends it (elastic_rm.wire.channel's format)."""
    head = HEADER.pack(MAGIC, VERSION, KIND_STEPS, pid, 0, 0) + STEPS.pack(completed, samples, len(durs))
    return head + struct.pack(f"<{2 * len(durs)}d", *durs, *busy)


def test_summary_pools_the_workers_step_times_into_quantiles_and_rates(channel):
    # 4 steps of 10 ms, then one of 30 ms, twice; a second worker: 4 steps of 20 ms
    channel.handle_datagram(steps_datagram(11, 5, 5 * 32, [0.01] * 4 + [0.03], [0.001] * 5))
    channel.handle_datagram(steps_datagram(11, 10, 5 * 32, [0.01] * 4 + [0.03], [0.002] * 5))
    channel.handle_datagram(steps_datagram(12, 4, 4 * 8, [0.02] * 4, [0.02] * 4))
    s = channel.summary()
    assert (s.steps, s.workers) == (14, 2), s
    assert s.p50_s == pytest.approx(0.01) and s.p90_s == pytest.approx(0.027), s  # numpy's quantiles
    assert s.busy_p50_s == pytest.approx(0.002), s
    assert s.samples_per_s == pytest.approx(320 / 0.14 + 32 / 0.08), s  # each worker's samples / its time
    assert channel.steps_total == 14 and channel.last_step[0] == 4
    assert set(channel.workers()) == {11, 12}


def test_step_times_reach_agent_as_quantiles_and_age_out(channel, pyprocs, step_worker, tmp_path):
    # 4 steps of 10 ms, then one of 30 ms: a step lasts at least its sleep, and one in five is slow.
    proc = pyprocs.python(
        step_worker, "--out", str(tmp_path), "--steps", "150", "--slow-every", "5", env=channel.env()
    )
    s = wait_for(lambda: (x := channel.summary()) and x.steps >= 40 and x, 10, "step reports")
    assert s.p50_s >= 0.01 and s.p90_s >= 0.03, s
    assert 0 < s.samples_per_s <= 32 / 0.01, s  # 32 samples a step, every step at least 10 ms
    assert s.workers == 1
    assert proc.pid in channel.workers()
    assert proc.wait(timeout=15) == 0
    assert channel.steps_total == 150  # every step arrived, none lost or doubled
    # reporting stopped: the window (1 s) empties and the summary becomes None
    wait_for(lambda: channel.summary() is None, 3, "step times to age out")
    assert proc.pid not in channel.workers()  # it said goodbye at exit


@pytest.mark.parametrize("mode", ["step", "iterate"])
def test_drain_stops_at_step_boundary_after_final_hook(channel, pyprocs, step_worker, tmp_path, mode):
    extra = ["--iterate"] if mode == "iterate" else []
    proc = pyprocs.python(step_worker, "--out", str(tmp_path), "--step-ms", "20", *extra, env=channel.env())
    wait_for(lambda: channel.steps_total >= 5, 10, "the worker to report steps")
    channel.request_drain()
    result = channel.wait_for_acks(timeout_s=5, pids=[proc.pid])
    assert result.complete and result.missing == () and result.failed == {}, result
    assert proc.wait(timeout=5) == 0  # a clean stop, not a kill
    saved = json.loads((tmp_path / "ckpt-0.json").read_text())["step"]
    logged = [int(x) for x in (tmp_path / "log-0.txt").read_text().split()]
    assert saved == logged[-1] == result.acked[proc.pid]  # the last completed step, nothing half done
    assert logged == list(range(1, saved + 1))
    assert json.loads((tmp_path / "exit-0.json").read_text()) == {
        "stopped": True,
        "steps": saved,
        "active": True,
    }


def test_drain_does_not_wait_for_scripts_without_the_api(channel, pyprocs):
    proc = pyprocs.python("-c", "import time; time.sleep(30)", env=channel.env())
    channel.request_drain()
    polled = []
    result = channel.wait_for_acks(timeout_s=600, pids=[proc.pid], alive=lambda p: polled.append(p) or True)
    assert result.unregistered == (proc.pid,) and result.complete
    assert polled == [] and proc.poll() is None  # nothing to wait for: not one look at the running script


def test_drain_grace_period_bounds_the_wait_for_a_stuck_worker(channel, pyprocs, step_worker, tmp_path):
    # A step of 20 s: the worker has said hello but reaches no step boundary within the grace period.
    proc = pyprocs.python(step_worker, "--out", str(tmp_path), "--step-ms", "20000", env=channel.env())
    wait_for(lambda: proc.pid in channel.workers(), 10, "the worker's hello")
    channel.request_drain()
    result = channel.wait_for_acks(timeout_s=0.5)
    assert result.missing == (proc.pid,) and not result.complete
    assert result.elapsed_s >= 0.5  # it gave the worker its whole grace period...
    log = tmp_path / "log-0.txt"
    assert proc.poll() is None and not (log.exists() and log.read_text())  # ...and not its 20 s step
    proc.kill()  # what the agent then does, as torchrun would
    proc.wait(timeout=5)
    assert channel.wait_for_acks(timeout_s=2).exited == (proc.pid,)


def test_cleared_drain_lets_the_next_workers_run(channel, pyprocs, step_worker, tmp_path):
    channel.request_drain()
    assert channel.drain_requested
    channel.clear_drain()
    assert not channel.drain_requested
    proc = pyprocs.python(
        step_worker, "--out", str(tmp_path), "--steps", "20", "--step-ms", "1", env=channel.env()
    )
    assert proc.wait(timeout=10) == 0
    assert json.loads((tmp_path / "exit-0.json").read_text())["stopped"] is False
    assert not (tmp_path / "ckpt-0.json").exists()


@contextlib.contextmanager
def two_nodes_of_one_rank(pyprocs, step_worker, tmp_path, free_port):
    """Two agent channels (two "nodes") and a gloo rank of the step worker on each (``--sync-every 4``),
    both stepping: (channel a, channel b, [rank 0, rank 1])."""
    a, b = AgentChannel(window_s=5).start(), AgentChannel(window_s=5).start()
    try:
        ps = []
        for rank, ch in enumerate((a, b)):
            env = {**ch.env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
            env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
            args = ["--out", str(tmp_path), "--step-ms", "5", "--gloo", "--sync-every", "4"]
            ps.append(pyprocs.python(step_worker, *args, env=env))
        wait_for(lambda: a.steps_total >= 10 and b.steps_total >= 10, 30, "both ranks to step")
        yield a, b, ps
    finally:
        a.close()
        b.close()


def test_ranks_agree_on_the_stop_step(pyprocs, step_worker, tmp_path, free_port):
    # Two ranks on two "nodes" (two agent channels). Only node A drains: with sync_every the all_reduce(MAX)
    # makes rank 1 stop too, at the same step, a multiple of sync_every. Without it rank 0 would stop alone
    # and rank 1 would hang in its next all_reduce.
    with two_nodes_of_one_rank(pyprocs, step_worker, tmp_path, free_port) as (a, b, ps):
        a.request_drain()
        result = a.wait_for_acks(timeout_s=10)
        assert result.complete and len(result.acked) == 1, result
        assert [p.wait(timeout=10) for p in ps] == [0, 0]
        steps = [json.loads((tmp_path / f"ckpt-{r}.json").read_text())["step"] for r in (0, 1)]
        assert steps[0] == steps[1] and steps[0] % 4 == 0
        for r in (0, 1):
            assert int((tmp_path / f"log-{r}.txt").read_text().split()[-1]) == steps[r]


def test_multi_rank_without_sync_never_stops_alone(pyprocs, step_worker, tmp_path, free_port, channel):
    # The drain is up before the ranks start; without sync_every they must not stop (a lone stop would
    # hang the peer in its next all_reduce): both run all their steps, as under torchrun.
    channel.request_drain()
    ps = []
    for rank in (0, 1):
        env = {**channel.env(), "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank)}
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port)}
        args = ["--out", str(tmp_path), "--steps", "40", "--step-ms", "2", "--gloo"]
        ps.append(pyprocs.python(step_worker, *args, env=env))
    assert [p.wait(timeout=30) for p in ps] == [0, 0]
    for r in (0, 1):
        assert json.loads((tmp_path / f"exit-{r}.json").read_text()) == {
            "stopped": False,
            "steps": 40,
            "active": True,
        }
        assert not (tmp_path / f"ckpt-{r}.json").exists()


def test_without_agent_dir_the_api_is_a_cheap_no_op(pyprocs, step_worker, tmp_path):
    proc = pyprocs.python(step_worker, "--out", str(tmp_path), "--steps", "30", "--step-ms", "1")
    assert proc.wait(timeout=10) == 0
    assert json.loads((tmp_path / "exit-0.json").read_text()) == {
        "stopped": False,
        "steps": 30,
        "active": False,
    }
    assert not (tmp_path / "ckpt-0.json").exists()
    # What a call costs is benchmarks/agent_overhead's figure; here: it returns before reading a clock.
    rep = StepReporter(agent_dir=None)
    n = 100_000
    for _ in range(n):
        rep.step(samples=8)
    assert rep.completed_steps == n and not rep.should_stop() and not rep.active
    assert rep.newest_step() is None  # no step was timed


def test_a_burst_of_reports_is_delivered_or_counted_as_dropped(channel):
    """What a reporting call costs is benchmarks/agent_overhead's figure, not a timed assertion here."""
    rep = StepReporter(agent_dir=channel.directory)
    n = 50_000
    for _ in range(n):
        rep.step(samples=8)
    rep.close()
    # Sub-microsecond "steps" in the agent's own process starve its receiver thread of the GIL, so some
    # batches may overflow and be dropped; every step is either delivered or counted as dropped.
    wait_for(lambda: channel.steps_total + rep._dropped == n, 5, "every step delivered or counted")
    assert channel.steps_total >= 4096


def test_malformed_datagrams_are_counted_and_dropped(channel):
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(str(Path(channel.directory) / SOCKET_NAME))
        for junk in (b"", b"hello", b"\xa1\xe7\x01\x02" + b"\0" * 12 + b"\x05"):
            s.send(junk)
    wait_for(lambda: channel.malformed_total == 3, 3, "the junk to be counted")
    rep = StepReporter(agent_dir=channel.directory, flush_interval_s=0)
    rep.step(samples=1)
    wait_for(lambda: channel.steps_total == 1, 3, "a good report after the junk")


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="sync_every"):
        StepReporter(agent_dir=None, sync_every=-1)
    with pytest.raises(ValueError, match="window"):
        AgentChannel(directory=str(tmp_path / "c"), window_s=0)
    with pytest.raises(ValueError, match="longer than"):
        AgentChannel(directory=str(tmp_path / ("x" * 120)))
    ch = AgentChannel(directory=str(tmp_path / "d"))
    try:
        assert ch.env() == {ENV_AGENT_DIR: str(tmp_path / "d")}
        with pytest.raises(ValueError, match="grace"):
            ch.wait_for_acks(timeout_s=-1)
    finally:
        ch.close()


def test_a_worker_stopped_by_its_peers_before_its_agent_asks_counts_as_drained(
    pyprocs, step_worker, tmp_path, free_port
):
    # `erm stop` (or a planned round) reaches node A's agent first: A drains, and with sync_every rank 1 on
    # node B stops at the same step and acks to B's agent, which sees the request only afterwards. B's
    # agent must count that ack: a worker it took for one without the API was never told to leave (in
    # rounds()), waited out the stop's exit limit and was killed.
    with two_nodes_of_one_rank(pyprocs, step_worker, tmp_path, free_port) as (a, b, ps):
        a.request_drain()
        assert len(a.wait_for_acks(timeout_s=10).acked) == 1
        assert [p.wait(timeout=10) for p in ps] == [0, 0]  # rank 1 acked to B and exited
        b.request_drain()  # B's agent asks only now
        result = b.wait_for_acks(timeout_s=0, pids=[ps[1].pid])
        step = json.loads((tmp_path / "ckpt-1.json").read_text())["step"]
        assert result.acked == {ps[1].pid: step} and result.unregistered == (), result
        b.clear_drain()  # the next round's workers: what the old ones said is forgotten
        b.request_drain()
        assert b.wait_for_acks(timeout_s=0, pids=[ps[1].pid]).unregistered == (ps[1].pid,)


def test_a_late_goodbye_of_the_last_round_does_not_count_in_the_next_drain():
    # A worker kept in place drained (ack, then goodbye); the agent went on at the ack, cleared the drain
    # for the new round, and only then read the goodbye. The worker's hello of the new round ends what it
    # said in the old one: at the next drain it is a live worker to wait for, not one that left.
    from elastic_rm.wire.channel import ACK, ACK_OK, HEADER, KIND_ACK, KIND_BYE, KIND_HELLO, MAGIC, VERSION

    pid = os.getpid()  # a live process

    def datagram(kind: int, body: bytes = b"") -> bytes:
        return HEADER.pack(MAGIC, VERSION, kind, pid, 0, 0) + body

    ch = AgentChannel(window_s=5)
    try:
        ch.handle_datagram(datagram(KIND_HELLO))
        ch.request_drain()
        ch.handle_datagram(datagram(KIND_ACK, ACK.pack(40, ACK_OK)))
        assert ch.wait_for_acks(timeout_s=0, pids=[pid]).acked == {pid: 40}
        ch.clear_drain()  # the new round, before the goodbye was read
        ch.handle_datagram(datagram(KIND_BYE))
        ch.handle_datagram(datagram(KIND_HELLO))  # the worker's new round
        ch.request_drain()
        result = ch.wait_for_acks(timeout_s=0, pids=[pid])
        assert result.missing == (pid,) and result.exited == () and result.acked == {}, result
    finally:
        ch.close()
