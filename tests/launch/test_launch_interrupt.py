"""A second Ctrl-C (or SIGTERM) while `erm launch` stops its nodes: every node is killed at once, and
erm launch says that every node was stopped only once they were. A real sshd on loopback, a real etcd,
real ermrun agents and gloo workers; the worker ignores SIGTERM, so that the graceful stop lasts."""

from __future__ import annotations

import os
import signal
import sys

import psutil

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.executor import Executor, ExecutorConfig
from elastic_rm.launch.hostfile import Host
from elastic_rm.launch.interrupts import Interrupts
from elastic_rm.launch.node import RemoteNode
from elastic_rm.launch.pool import HostPool
from elastic_rm.obs.events import EventLog
from elastic_rm.proc import kill_tree
from elastic_rm.wire.keyspace import Keyspace
from tests.e2e.helpers import records, steps_at_world, wait_until
from tests.launch.test_launch_ssh import hostfile, launch

# a node's ssh client that does not end on SIGTERM nor at the end of its input (a hung connection); it
# writes the lines it reads (the supervisor's input) to the file named by its argument
STUCK = (
    "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "for line in sys.stdin:\n"
    "    with open(sys.argv[1], 'a') as out: out.write(line)\n"
    "time.sleep(120)"
)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_second_ctrl_c_during_the_stop_kills_every_node_at_once(etcd, run_id, tmp_path, procs, ssh_hosts):
    hosts = hostfile(tmp_path, "h1 addr=127.0.0.1\n")
    extra = ["--stop-grace", "60", "--env", "IGNORE_SIGTERM=1"]
    p = launch(tmp_path, ssh_hosts, etcd, run_id, hosts, "1", steps_max=0, extra=extra)
    procs.append(p)
    wait_until(lambda: steps_at_world(tmp_path, "h1", 1) > 1, 120, "the node's worker steps", [p])
    worker = next(r["pid"] for r in records(tmp_path, "h1") if r.get("start"))
    os.kill(p.pid, signal.SIGINT)  # the launcher alone, as a terminal's Ctrl-C would
    wait_until(lambda: "stopping ermrun" in p.output(), 60, "the host's supervisor stopping ermrun", [p])
    assert not gone(worker)  # it ignores the stop's SIGTERM: only a kill ends it
    os.kill(p.pid, signal.SIGINT)
    assert p.wait(60) == 130, p.output()[-3000:]
    assert gone(worker), p.output()[-3000:]  # killed before erm launch returned
    out = p.output()
    assert "Traceback" not in out, out[-3000:]
    assert "interrupted again" in out and "interrupted: every node was stopped" in out, out[-3000:]
    assert "[h1] [erm launch] killing ermrun and its workers on request" in out, out[-3000:]
    assert "node h1 stopped (exit 137)" in out, out[-3000:]  # its ermrun was killed, not left


def test_a_third_signal_returns_without_waiting_and_names_the_nodes_left_with_their_pids(
    etcd, run_id, tmp_path
):
    """The second and third signal both came before the stop began: the hurried kill is still sent."""
    keys = Keyspace("/elastic-rm", run_id)
    said: list[str] = []
    with EtcdClient(etcd.endpoint) as client:
        events = EventLog(run_id, "erm-launch", client=client, keys=keys)
        host = Host("h1", "127.0.0.1")
        pool = HostPool()
        pool.add(host)
        with Interrupts(how="killed") as interrupts:
            executor = Executor(
                client,
                keys,
                pool,
                None,
                events,
                ExecutorConfig(1, 1, stop_grace_s=60),
                said.append,
                interrupts=interrupts,
            )
            pool.take("h1")
            node = executor.nodes["h1"] = RemoteNode(
                host, [sys.executable, "-c", STUCK, str(tmp_path / "input")], said.append
            )
            try:
                interrupts.stop()  # the first signal's stop began: the next two hurry it, then leave
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGTERM)
                assert interrupts.hurry and interrupts.leave
                assert executor.stop_all("the test stops the run") == ["h1"]
                assert node.poll() is None  # returned without waiting for it, or killing it
                assert executor.stop_all("again") == ["h1"]  # a later call names the same
                read = tmp_path / "input"
                wait_until(lambda: read.exists() and "kill" in read.read_text(), 30, "the 'kill' line")
            finally:
                kill_tree(node.pid)
        events.close()
    assert any("h1 may still run" in line and f"`kill {node.pid}`" in line for line in said), said


def test_a_first_signal_during_a_stop_erm_launch_began_by_itself_hurries_it_and_says_so(capfd):
    with Interrupts(how="killed") as interrupts:
        interrupts.stop()  # the run's end, or an error: no signal yet
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupts.hurry and not interrupts.leave
        os.kill(os.getpid(), signal.SIGINT)
        assert interrupts.leave
    said = capfd.readouterr().err.splitlines()
    assert said[0].startswith("erm launch: interrupted: stopping the run's nodes now (killed)"), said
    assert said[1].startswith("erm launch: interrupted again: returning without waiting"), said


def test_the_erm_stop_line_reaches_the_runs_etcd_as_erm_launch_does():
    from types import SimpleNamespace

    from elastic_rm.etcd.options import TlsOptions
    from launcher.commands.launch import _stop_command

    def line(prefix: str, tls: TlsOptions, user: str | None) -> str:
        settings = SimpleNamespace(keys=Keyspace(prefix, "r1"), tls=tls, user=user)
        return _stop_command(
            SimpleNamespace(settings=settings, ns=SimpleNamespace(rdzv_endpoint="e:2379")), "r1"
        )

    assert line("/elastic-rm", TlsOptions(), None) == "erm stop r1 --endpoint e:2379"
    assert line("/team-a", TlsOptions("my ca.pem", "c.pem", "k.pem"), "u") == (
        "erm stop r1 --endpoint e:2379 --prefix /team-a --etcd-cacert 'my ca.pem' --etcd-cert c.pem "
        "--etcd-key k.pem --etcd-user u"
    )


def test_the_wait_for_ermruns_parser_thread_ends_on_one_more_signal(monkeypatch):
    """An interrupted erm launch --slurm waits for the parser thread (loading torch, or connecting to an
    etcd that does not answer: here one that waits for the test) to close its etcd client; a third signal
    returns without waiting for it."""
    import argparse
    import threading

    from launcher.commands import launch as launch_command

    monkeypatch.setattr(launch_command, "PARSER_WAIT_S", 600.0)  # the bound would only come much later
    busy = threading.Event()
    parser = launch_command._ParserCheck(argparse.Namespace())
    parser.run = lambda: busy.wait(120)

    def two_more_signals() -> None:
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGTERM)

    try:
        with Interrupts() as interrupts:
            interrupts.stop()  # the first signal's stop began
            parser.start()
            threading.Thread(target=two_more_signals).start()
            parser.close_client(interrupts)
            assert interrupts.leave and parser.is_alive()  # returned on the signal, not on the thread's end
    finally:
        busy.set()
        parser.join(30)


def test_a_node_past_its_stop_grace_is_killed_while_etcd_is_unreachable(run_id, tmp_path):
    """A node told to stop whose ssh client does not end: killed once the stop's bound is over, whether or
    not the launcher can read the run from etcd (an etcd outage must not keep a node running)."""
    from tests.launch.sshd import closed_port

    keys = Keyspace("/elastic-rm", run_id)
    said: list[str] = []
    with EtcdClient(f"127.0.0.1:{closed_port()}", timeout=0.5) as client:
        host = Host("h1", "127.0.0.1")
        pool = HostPool()
        pool.add(host)
        events = EventLog(run_id, "erm-launch", client=client, keys=keys)
        executor = Executor(
            client, keys, pool, None, events, ExecutorConfig(1, 1, stop_grace_s=1), said.append
        )
        pool.take("h1")
        node = executor.nodes["h1"] = RemoteNode(
            host, [sys.executable, "-c", STUCK, str(tmp_path / "input")], said.append
        )
        try:
            node.request_stop("the test gives it back")
            assert executor.tick() is None and node.poll() is None  # within its bound
            node.stop_requested_at -= 12  # the stop grace and the 10 s after it are over
            assert executor.tick() is None
            assert gone(node.pid), said
        finally:
            kill_tree(node.pid)
    assert any("cannot read the run from etcd" in s for s in said), said
    assert any("did not stop within 11s" in s for s in said), said
