"""`erm launch` refuses bad input before it starts anything, with a message that says what to do."""

from __future__ import annotations

import pytest

from launcher.erm import main


def erm_launch(capsys, *args: str) -> tuple[int, str]:
    rc = main(["launch", *args])
    return rc, capsys.readouterr().err


def job(endpoint: str = "127.0.0.1:2379") -> list[str]:
    return ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "cli-test", "train.py", "--lr", "1"]


def test_a_malformed_hostfile_line_is_named(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# racks\nh1 addr=127.0.0.1\nh2 slots=two\n")
    rc, err = erm_launch(capsys, "--hostfile", str(hosts), *job())
    assert rc == 2
    assert f"hostfile {hosts}, line 3: slots=two must be a whole number >= 1" in err


def test_an_ssh_key_that_does_not_exist(capsys, tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\n")
    rc, err = erm_launch(capsys, "--hostfile", str(hosts), "--ssh-identity", str(tmp_path / "nokey"), *job())
    assert rc == 2 and "ssh identity file" in err and "does not exist" in err and "--ssh-identity" in err


def test_a_discovery_script_that_exits_non_zero(capsys):
    rc, err = erm_launch(capsys, "--discovery-script", "echo 'no inventory' >&2; exit 4", *job())
    assert rc == 2 and "exited with 4: no inventory" in err


def test_a_discovery_script_that_hangs_times_out(capsys):
    rc, err = erm_launch(capsys, "--discovery-script", "sleep 300", "--discovery-timeout", "1", *job())
    assert rc == 2 and "did not finish within 1s (--discovery-timeout)" in err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--nnodes", "2", "train.py"], "needs --rdzv-endpoint"),
        (["--standalone", "train.py"], "needs --rdzv-endpoint"),
        (["--rdzv-endpoint", "e:2379", "--node-id", "x", "train.py"], "remove --node-id"),
        (["--rdzv-endpoint", "e:2379", "--rdzv-backend", "c10d", "train.py"], "remove --rdzv-backend c10d"),
        (["--rdzv-endpoint", "e:2379", "--nnodes", "3:1", "train.py"], "nnodes"),
    ],
)
def test_ermrun_flags_that_cannot_work_across_hosts(capsys, tmp_path, flags, message):
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\n")
    rc, err = erm_launch(capsys, "--hostfile", str(hosts), *flags)
    assert rc == 2 and message in err, err


def test_an_unreachable_etcd_is_reported(capsys, tmp_path):
    from tests.launch.sshd import closed_port

    hosts = tmp_path / "hosts"
    hosts.write_text("h1\n")
    rc, err = erm_launch(capsys, "--hostfile", str(hosts), *job(f"127.0.0.1:{closed_port()}"))
    assert rc == 2 and "cannot reach etcd" in err


def test_ermrun_flags_and_script_arguments_pass_through_unchanged(tmp_path):
    """What each host's ermrun gets: the user's flags as typed, then the node's id and slots, then the
    script."""
    from elastic_rm.launch.command import NodeCommand
    from elastic_rm.launch.hostfile import parse_hosts
    from elastic_rm.launch.ssh import SshOptions
    from launcher.erm import build_parser

    args = build_parser().parse_args(
        [
            "launch",
            "--hostfile",
            "h",
            "--nnodes",
            "1:2",
            "--rdzv-conf=lease_ttl=2",
            "-r",
            "3",
            "--standalone",
            "--max-restarts",
            "-1",
            "train.py",
            "--nnodes",
            "7",
            "--lr",
            "1",
        ]
    )
    assert args.ermrun_flags == [
        "--nnodes",
        "1:2",
        "--rdzv-conf",
        "lease_ttl=2",
        "-r",
        "3",
        "--standalone",
        "--max-restarts=-1",
    ]
    assert [args.training_script, *args.training_script_args] == ["train.py", "--nnodes", "7", "--lr", "1"]
    host = parse_hosts("n1 addr=10.0.0.1 port=2200 user=u slots=4\n", "t")[0]
    cmd = NodeCommand(
        SshOptions(), "/py", "/wd", ("--nnodes", "1:2"), ("train.py", "--lr", "1"), {"A": "x y"}
    )
    assert cmd.ermrun_argv(host) == [
        "--nnodes",
        "1:2",
        "--node-id",
        "n1",
        "--nproc-per-node",
        "4",
        "train.py",
        "--lr",
        "1",
    ]
    argv = cmd.argv(host)
    assert (
        argv[argv.index("-p") + 1] == "2200" and argv[argv.index("-l") + 1] == "u" and argv[-2] == "10.0.0.1"
    )
    assert argv[-1].startswith(
        "cd /wd && exec env A='x y' ERM_LAUNCH_HOST=n1 PYTHONUNBUFFERED=1 /py -m elastic_rm.launch.remote"
    )


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--rdzv-conf", "lease_ttl=2.5"], "lease_ttl=2.5 must be a whole number of seconds"),
        (["--rdzv-conf", "etcd_timeout=0"], "etcd_timeout='0' must be greater than 0"),
        (["--rdzv-conf", "lease_ttl"], "lease_ttl"),  # not key=value
        (["--rdzv-conf", "lease_tll=3"], "unknown key 'lease_tll'; did you mean 'lease_ttl'?"),
        (["--etcd-user", "alice"], "etcd user given without a password"),
        (["--etcd-cert", "client.pem"], "etcd TLS"),  # a client certificate without its key
    ],
)
def test_rendezvous_settings_are_checked_by_the_rendezvous_own_reader(
    capsys, tmp_path, monkeypatch, flags, message
):
    """--rdzv-conf and the --etcd-* flags go through RendezvousSettings, as on every node: a bad value
    fails here, before any host is contacted, with the message a node would give."""
    monkeypatch.delenv("ELASTIC_RM_ETCD_PASSWORD", raising=False)
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\n")
    rc, err = erm_launch(capsys, "--hostfile", str(hosts), *flags, *job())
    assert rc == 2 and message in err, err


def test_the_run_is_looked_up_under_the_rdzv_conf_prefix(capsys, tmp_path, etcd, run_id):
    """The prefix comes from the settings too: a closed run under a custom prefix is found there."""
    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.wire.keyspace import Keyspace

    with EtcdClient(etcd.endpoint, timeout=5) as client:
        client.put(Keyspace("/elsewhere", run_id).closed, '{"v": 1}')
    hosts = tmp_path / "hosts"
    hosts.write_text("h1\n")
    flags = ["--nnodes", "1:2", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "train.py"]
    rc, err = erm_launch(capsys, "--hostfile", str(hosts), "--rdzv-conf", "prefix=/elsewhere", *flags)
    assert rc == 2 and f"run {run_id} is closed already" in err, err
