"""Bugs found in `erm launch` (ssh path): a host back in the discovery output while its node still stops,
a signal while the discovery script runs, a signal during startup, a negative --poll-interval, and
--call-in without --slurm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.executor import Executor, ExecutorConfig
from elastic_rm.launch.hostfile import Host
from elastic_rm.launch.pool import HostPool
from elastic_rm.obs.events import EventLog
from elastic_rm.wire.keyspace import Keyspace
from tests.launch.sshd import closed_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def client(etcd):
    """The session's etcd; the executor reads a run of its own there, of which nothing exists."""
    with EtcdClient(etcd.endpoint) as c:
        yield c


def one_host_executor(client, run_id, host: Host, start, say, discover=None) -> tuple[Executor, HostPool]:
    """An executor of a run of which nothing is in etcd (no demand, round, node registered or close) over
    ``host`` and its pool; with ``discover``, the host list it reads again at every tick."""
    pool = HostPool()
    pool.add(host)
    if discover is None:
        config, extra = ExecutorConfig(1, 1), {}
    else:
        config = ExecutorConfig(1, 1, discovery_interval_s=0)
        extra = {"discover": discover, "known_hosts": [host]}
    executor = Executor(
        client,
        Keyspace("/elastic-rm", run_id),
        pool,
        start,
        EventLog("r1", "erm-launch"),
        config,
        say,
        **extra,
    )
    return executor, pool


class _Node:
    """A started node as the executor sees it; ends only when the test says so."""

    def __init__(self, host: Host):
        self.host, self.started_at, self.pid = host, time.monotonic(), 0
        self.stop_requested_at: float | None = None
        self.stop_reason, self.registered, self.rc = "", False, None

    node_id = property(lambda self: self.host.node_id)
    stopping = property(lambda self: self.stop_requested_at is not None)

    def poll(self):
        return self.rc

    def request_stop(self, reason: str) -> None:
        self.stop_requested_at, self.stop_reason = time.monotonic(), reason

    def tail(self, lines: int = 5) -> str:
        return ""

    def kill(self) -> None:
        self.rc = -9

    kill_now = kill


def test_a_host_back_in_the_discovery_output_waits_for_its_stopping_node_to_end(client, run_id):
    """h1 leaves the discovery output (its node is told to stop) and comes back before that node ended:
    no second node starts on h1 meanwhile (it would run under the same node id, and the first one would no
    longer be followed, nor stopped when erm launch ends); once the first one ended, h1 gets a node."""
    h1 = Host("h1", "127.0.0.1")
    answers = [[h1], [], [h1], [h1], [h1]]
    started: list[_Node] = []

    def start(host: Host) -> _Node:
        started.append(_Node(host))
        return started[-1]

    executor, _ = one_host_executor(client, run_id, h1, start, lambda _: None, lambda: answers.pop(0))
    executor.tick()  # h1 listed: its node starts
    executor.tick()  # h1 gone: its node is told to stop
    assert len(started) == 1 and started[0].stopping
    executor.tick()  # h1 back, its node still stopping
    assert len(started) == 1, "a second node started on h1 while its first one still ran"
    assert executor.nodes["h1"] is started[0]
    started[0].rc = 143  # the first node ended
    executor.tick()
    assert len(started) == 2 and executor.nodes["h1"] is started[1]


def test_a_signal_while_the_discovery_script_runs_kills_the_script(tmp_path):
    """The script runs in a session of its own (a timeout kills its tree), which a terminal's Ctrl-C does
    not reach: erm launch interrupted while it runs must not leave it behind."""
    pid_file = tmp_path / "pid"
    code = (
        "from elastic_rm.launch.discovery import run_discovery\n"
        f"run_discovery('echo $$ > {pid_file}; exec sleep 300', 60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        script = int(pid_file.read_text())
        os.kill(proc.pid, signal.SIGINT)
        proc.wait(30)
        time.sleep(0.2)
        alive = psutil.pid_exists(script) and psutil.Process(script).status() != psutil.STATUS_ZOMBIE
        if alive:
            os.kill(script, signal.SIGKILL)
        assert not alive, "the discovery script outlived the interrupted launcher"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _erm_launch(tmp_path, *flags: str) -> subprocess.Popen:
    """erm launch with SIGINT at its default (a test runner's background job may ignore it)."""
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.erm", "launch", *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def test_ctrl_c_while_erm_launch_starts_exits_130_without_a_traceback_or_the_script(tmp_path):
    pid_file = tmp_path / "pid"
    proc = _erm_launch(
        tmp_path,
        "--discovery-script",
        f"echo $$ > {pid_file}; exec sleep 300",
        "--rdzv-endpoint",
        f"127.0.0.1:{closed_port()}",
        "--nnodes",
        "1",
        "train.py",
    )
    try:
        deadline = time.monotonic() + 120
        while not (pid_file.exists() and pid_file.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.05)
        script = int(pid_file.read_text())
        os.kill(proc.pid, signal.SIGINT)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    time.sleep(0.2)
    alive = psutil.pid_exists(script) and psutil.Process(script).status() != psutil.STATUS_ZOMBIE
    if alive:
        os.kill(script, signal.SIGKILL)
    assert proc.returncode == 130, out
    assert "Traceback" not in out, out
    assert "interrupted before the run started" in out, out
    assert not alive, "the discovery script outlived erm launch"


def test_a_negative_poll_interval_or_call_in_without_slurm_is_refused_before_anything_starts(
    tmp_path, capsys
):
    from launcher.erm import main

    hosts = tmp_path / "hosts"
    hosts.write_text("h1 addr=127.0.0.1\n")
    argv = ["launch", "--hostfile", str(hosts), "--rdzv-endpoint", f"127.0.0.1:{closed_port()}"]
    assert main([*argv, "--poll-interval", "-1", "--nnodes", "1", "train.py"]) == 2
    assert "--poll-interval -1: must be a number of seconds > 0" in capsys.readouterr().err
    assert main([*argv, "--stop-grace", "nan", "--nnodes", "1", "train.py"]) == 2
    assert "--stop-grace nan" in capsys.readouterr().err
    assert main([*argv, "--call-in", "--nnodes", "1", "train.py"]) == 2  # Slurm's nodes only
    assert "--call-in lends Slurm nodes: it works with --slurm only" in capsys.readouterr().err


def test_a_host_blacklisted_again_and_again_never_overflows_its_cooldown():
    """The cooldown doubles per blacklisting up to the maximum; with the command line's float seconds,
    2**1024 used to raise OverflowError at a host's 1025th blacklisting (a dead host kept in a hostfile:
    about a week of a run at the defaults), which ended erm launch and every node of the run."""
    now = [0.0]
    pool = HostPool(1, 60.0, 600.0, clock=lambda: now[0])
    pool.add(Host("h1", "h1"))
    for _ in range(1100):
        cooldown = pool.failed("h1", "ssh: connection refused")
        now[0] += cooldown + 1
    assert cooldown == 600.0 and pool.get("h1").strikes == 1100


def test_a_nan_cooldown_is_refused():
    with pytest.raises(ValueError):
        HostPool(2, float("nan"), 600.0)


def test_an_address_that_ssh_would_read_as_an_option_is_a_malformed_line():
    from elastic_rm.launch.hostfile import HostfileError, parse_hosts

    with pytest.raises(HostfileError, match="line 2: address '-oProxyCommand' is not a host name"):
        parse_hosts("h0\nn1 addr=-oProxyCommand\n", "hostfile h")
    assert parse_hosts("n1 addr=::1\n", "hostfile h")[0].addr == "::1"


def test_a_discovery_script_that_keeps_failing_is_warned_about_once_per_spell(client, run_id):
    """docs/launch.md: a later failure of the script is warned about once and the last good host list is
    kept. A script whose stderr differs at each run (a timestamp, a curl timing) was warned about at every
    poll; a spell after the script worked again is warned about again."""
    from elastic_rm.launch.discovery import run_discovery

    h1 = Host("h1", "h1")
    failing = 'echo "lookup failed at $(date +%s%N)" >&2; exit 1'
    scripts = [failing] * 4 + ["echo h1"] + [failing] * 2
    said: list[str] = []
    discover = lambda: run_discovery(scripts.pop(0), 10)  # noqa: E731
    executor, pool = one_host_executor(client, run_id, h1, _Node, said.append, discover)
    for _ in range(7):
        executor.tick()
    warnings = [s for s in said if "keeping the last host list" in s]
    assert len(warnings) == 2, said
    assert "h1" in pool


def test_a_hostfile_saved_with_a_byte_order_mark_and_crlf_is_read(tmp_path):
    from elastic_rm.launch.hostfile import read_hostfile

    path = tmp_path / "hosts"
    path.write_bytes(b"\xef\xbb\xbfgpu01 slots=8\r\ngpu02\r\n")
    assert [(h.name, h.slots) for h in read_hostfile(str(path))] == [("gpu01", 8), ("gpu02", None)]


def test_an_events_file_that_cannot_be_opened_is_refused_before_anything_starts(tmp_path, capsys):
    """With --slurm it was checked up front; over ssh, EventLog raised FileNotFoundError with a traceback
    once etcd had answered."""
    from launcher.erm import main

    hosts = tmp_path / "hosts"
    hosts.write_text("h1 addr=127.0.0.1\n")
    argv = ["launch", "--hostfile", str(hosts), "--rdzv-endpoint", f"127.0.0.1:{closed_port()}"]
    assert main([*argv, "--events-file", "/proc/erm/events.jsonl", "--nnodes", "1", "train.py"]) == 2
    assert "--events-file /proc/erm/events.jsonl: cannot open it" in capsys.readouterr().err


def test_a_node_that_fails_after_a_long_output_line_is_reported_not_a_crash(client, run_id):
    """A failure's event carries the node's last output lines; one long line (a progress bar redrawn with
    \\r and no newline, a config dump) made it larger than the event log takes (16 KiB): ValueError out of
    the executor's loop ended erm launch and with it every node of the run."""
    from elastic_rm.launch.node import RemoteNode

    h1 = Host("h1", "127.0.0.1")
    long_lines = "print('\\U0001f600' * 20000); print('loss ' + 'x' * 20000); print('\\r' * 9000 + 'y')"
    argv = [sys.executable, "-c", f"{long_lines}; raise SystemExit(3)"]
    said: list[str] = []
    start = lambda host: RemoteNode(host, argv, lambda line: None)  # noqa: E731
    executor, _ = one_host_executor(client, run_id, h1, start, said.append)
    try:
        executor.tick()  # starts the node
        deadline = time.monotonic() + 30
        while executor.nodes["h1"].poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        executor.tick()  # its failure is reported
        assert any("node h1 failed: ermrun on h1 exited with 3" in s for s in said), said
    finally:
        executor.stop_all("test over")


@pytest.mark.slow  # 6 s; CI keeps test_events.py's clipping and the long-output-line executor case above
def test_a_hostfile_of_many_long_names_starts_a_run(etcd, run_id, tmp_path, capsys):
    """The begin event listed every host: 200 names of 120 characters (or 600 of 30) made it larger than
    the event log takes (16 KiB), and erm launch ended with a ValueError traceback at its start. Here each
    node's "ssh" is /bin/false: every host fails once, is blacklisted, and erm launch gives up (exit 1)."""
    from launcher.erm import main

    hosts = tmp_path / "hosts"
    hosts.write_text("".join(f"{'n' * 116}{i:04d} addr=127.0.0.1\n" for i in range(200)))
    rc = main(
        [
            "launch",
            "--hostfile",
            str(hosts),
            "--ssh-binary",
            "/bin/false",
            "--host-failures",
            "1",
            "--poll-interval",
            "0.02",
            "--rdzv-endpoint",
            etcd.endpoint,
            "--rdzv-id",
            run_id,
            "--nnodes",
            "1",
            "train.py",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 1, err[-3000:]
    assert "every host is blacklisted" in err, err[-3000:]
