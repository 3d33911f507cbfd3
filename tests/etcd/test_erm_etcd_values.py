"""`erm etcd` values, in-process with --print-command (etcd is never started): an IPv6 host goes into etcd's
URLs in brackets (etcd rejected ``http://::1:2379`` and printed its usage), the printed command line
survives a shell (a --data-dir with a space), and a bad --initial-cluster is one clear line instead of
etcd's fatal JSON log line with a Go stack trace."""

from __future__ import annotations

import argparse
import shlex

import pytest

from launcher.commands import etcd as erm_etcd


def _run(capsys, *argv: str) -> tuple[int, list[str], str]:
    parser = argparse.ArgumentParser()
    erm_etcd.add_arguments(parser)
    code = erm_etcd.run(parser.parse_args([*argv, "--print-command"]))
    out, err = capsys.readouterr()
    return code, shlex.split(out), err


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_ipv6_hosts_are_bracketed_in_etcds_urls(capsys):
    code, cmd, _ = _run(capsys, "--name", "m1", "--listen-host", "::", "--advertise-host", "fd00::2")
    assert code == 0
    assert _flag(cmd, "--listen-client-urls") == "http://[::]:2379"
    assert _flag(cmd, "--advertise-client-urls") == "http://[fd00::2]:2379"
    assert _flag(cmd, "--listen-peer-urls") == "http://[::]:2380"
    assert _flag(cmd, "--initial-cluster") == "m1=http://[fd00::2]:2380"


def test_ipv4_and_names_are_unchanged(capsys):
    code, cmd, _ = _run(capsys, "--name", "m1", "--listen-host", "0.0.0.0", "--advertise-host", "etcd1")
    assert code == 0
    assert _flag(cmd, "--listen-client-urls") == "http://0.0.0.0:2379"
    assert _flag(cmd, "--initial-cluster") == "m1=http://etcd1:2380"


def test_the_printed_command_keeps_a_data_dir_with_a_space(capsys, tmp_path):
    data = tmp_path / "etcd data"
    code, cmd, _ = _run(capsys, "--name", "m1", "--data-dir", str(data))
    assert code == 0 and _flag(cmd, "--data-dir") == str(data)


@pytest.mark.parametrize(
    "cluster, message",
    [
        ("m1", "entry 'm1' is not NAME=http://HOST:PEERPORT"),
        ("m1=etcd1:2380", "is not NAME=http://HOST:PEERPORT"),
        ("=http://etcd1:2380", "is not NAME=http://HOST:PEERPORT"),
        ("etcd1=http://etcd1:2380,etcd2=http://etcd2:2380", "names etcd1, etcd2 but not this member, 'm1'"),
    ],
)
def test_a_bad_initial_cluster_is_one_clear_error(capsys, cluster, message):
    code, cmd, err = _run(capsys, "--name", "m1", "--initial-cluster", cluster)
    assert code == 2 and cmd == []
    assert err.startswith("erm etcd: error: --initial-cluster") and message in err


def test_a_good_initial_cluster_passes(capsys):
    cluster = "m1=http://etcd1:2380,m2=https://etcd2:2380,m3=http://[fd00::3]:2380,"
    code, cmd, _ = _run(capsys, "--name", "m1", "--initial-cluster", cluster)
    assert code == 0 and _flag(cmd, "--initial-cluster") == cluster


def test_a_data_dir_that_is_a_file_is_one_clear_error(capsys, tmp_path):
    (tmp_path / "data").write_text("not a directory")
    code, cmd, err = _run(capsys, "--name", "m1", "--data-dir", str(tmp_path / "data"))
    assert code == 2 and cmd == [] and "--data-dir" in err and "is a file, not a directory" in err


@pytest.mark.parametrize("cluster", [None, "m1=http://etcd1:2380"])
def test_join_without_the_running_members_is_one_clear_error(capsys, cluster):
    argv = ["--name", "m1", "--join"] + (["--initial-cluster", cluster] if cluster else [])
    code, cmd, err = _run(capsys, *argv)
    assert code == 2 and cmd == [] and "--join needs --initial-cluster with the running members" in err


def test_join_with_the_running_members_passes(capsys):
    cluster = "m0=http://etcd0:2380,m1=http://etcd1:2380"
    code, cmd, _ = _run(capsys, "--name", "m1", "--join", "--initial-cluster", cluster)
    assert code == 0 and _flag(cmd, "--initial-cluster-state") == "existing"
