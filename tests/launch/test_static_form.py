"""torchrun's static multi-node form under ermrun (--nnodes N --node-rank R --master-addr A --master-port P):
node rank 0 starts the run's etcd at A:P, the other nodes join it there."""

from __future__ import annotations

import signal
import socket
import subprocess
import time

import pytest

from elastic_rm.etcd.server import free_port
from elastic_rm.launch.slurm import apply_slurm
from elastic_rm.launch.static_form import StaticForm, check_port_free, wait_for_master
from launcher.ermrun import build_parser, prepare
from tests.e2e.helpers import STEPS, ermrun, records
from tests.ermrun_argv import ERMRUN
from tests.launch.test_slurm import SRUN


def parsed(*flags: str):
    parser = build_parser()
    return parser.parse_args([*flags, "train.py"]), parser


def test_a_joining_node_takes_its_endpoint_from_master_addr_and_port():
    args, _ = parsed(
        "--nnodes", "2:4", "--node-rank", "3", "--master-addr", "10.1.2.3", "--master-port", "4100"
    )
    embedded, form = prepare(args)
    assert form == StaticForm("10.1.2.3", 4100, hosts_etcd=False)
    assert not embedded and args.rdzv_endpoint == "10.1.2.3:4100"
    assert args.node_rank == 0  # used: torch's parsing would warn that it ignores it


def test_node_rank_0_hosts_the_etcd_on_torchruns_default_port():
    args, _ = parsed("--nnodes", "2", "--master-addr", "head")
    _, form = prepare(args)
    assert form == StaticForm("head", 29500, hosts_etcd=True) and args.rdzv_endpoint == ""
    ipv6, _ = parsed("--nnodes", "2", "--node-rank", "1", "--master-addr", "fd00::1")
    form6 = prepare(ipv6)[1]
    assert form6.endpoint == "[fd00::1]:29500" and form6.listen_host == "::"  # node 0 listens on IPv6


@pytest.mark.parametrize(
    "flags",
    [
        ("--nnodes", "2"),  # nothing of the form given: the embedded loopback etcd, as before
        ("--nnodes", "1", "--master-addr", "head"),  # one node: nobody joins
        ("--nnodes", "2", "--master-addr", "head", "--rdzv-endpoint", "etcd1:2379"),  # an etcd named
        ("--nnodes", "2", "--master-addr", "head", "--rdzv-backend", "c10d", "--rdzv-endpoint", "h:1"),
        ("--standalone", "--nnodes", "2", "--master-addr", "head"),
    ],
)
def test_the_form_applies_only_where_torchrun_would_use_the_master(flags):
    args, _ = parsed(*flags)
    endpoint = args.rdzv_endpoint
    _, form = prepare(args)
    assert form is None
    assert args.rdzv_endpoint in (endpoint, "")


@pytest.mark.parametrize(
    "flags,message",
    [
        (("--nnodes", "2", "--node-rank", "2", "--master-addr", "head"), "--node-rank must be in [0, 2)"),
        (("--nnodes", "2", "--master-addr", "head", "--master-port", "70000"), "--master-port must be"),
        (("--nnodes", "2", "--node-rank", "1", "--master-addr", ""), "--master-addr is empty"),
    ],
)
def test_bad_static_form_flags_are_refused_naming_the_flag(flags, message):
    args, _ = parsed(*flags)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        prepare(args)


def test_inside_srun_the_master_flags_keep_slurms_endpoint_out():
    args, parser = parsed("--node-rank", "1", "--master-addr", "node01", "--master-port", "29400")
    apply_slurm(args, parser, SRUN)
    assert args.nnodes == "3" and args.rdzv_endpoint == ""  # node count from Slurm, etcd from the form
    assert prepare(args)[1] == StaticForm("node01", 29400, hosts_etcd=False)
    assert args.rdzv_endpoint == "node01:29400"


def test_a_joining_node_waits_for_the_master_and_says_so_once():
    port = free_port()
    form = StaticForm("127.0.0.1", port, hosts_etcd=False)
    said: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(ValueError) as refused:
        wait_for_master(form, 1.2, on_wait=said.append)
    assert time.monotonic() - t0 >= 1.0
    assert f"node rank 0's etcd at 127.0.0.1:{port} did not answer in 1s" in str(refused.value)
    assert "--rdzv-conf join_timeout" in str(refused.value) and len(said) == 1
    with socket.create_server(("127.0.0.1", port)):
        assert wait_for_master(form, 5, on_wait=said.append) < 1 and len(said) == 1


def test_two_nodes_in_the_static_form_train_as_one_run(tmp_path, procs):
    """Node rank 1 starts first and waits; node rank 0 starts the etcd; both train at world 2 and exit 0."""
    port = free_port()
    form = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port), "--spares", "off"]
    joiner = ermrun(tmp_path, "b", [*form, "--node-rank", "1", "--node-id", "b"], steps_max=3)
    procs.append(joiner)
    time.sleep(1.5)
    host = ermrun(tmp_path, "a", [*form, "--node-rank", "0", "--node-id", "a"], steps_max=3)
    procs.append(host)
    for p in (host, joiner):
        assert p.wait(120) == 0, p.output()[-3000:]
    starts = [r for n in ("a", "b") for r in records(tmp_path, n) if r.get("start")]
    assert sorted(r["rank"] for r in starts) == [0, 1] and {r["world"] for r in starts} == {2}
    assert "waiting for node rank 0's etcd" in joiner.output()
    assert "node_rank is only used for static" not in host.output() + joiner.output()


def test_node_rank_0_names_the_port_it_cannot_listen_on():
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"--master-port {port}: .*(Address already in use)"):
            check_port_free(StaticForm("127.0.0.1", port, hosts_etcd=True))
    check_port_free(StaticForm("127.0.0.1", port, hosts_etcd=True))  # free again: no error


def test_ctrl_c_while_waiting_for_the_master_ends_without_a_traceback(tmp_path):
    port = free_port()
    argv = [
        ERMRUN,
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
    ]
    p = subprocess.Popen([*argv, STEPS], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        said = ""
        while "waiting for node rank 0's etcd" not in said and time.monotonic() < deadline:
            said += p.stderr.readline()
        p.send_signal(signal.SIGINT)
        _, rest = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130, said + rest
    assert f"interrupted while waiting for 127.0.0.1:{port}; nothing started" in rest
    assert "Traceback" not in said + rest
