"""Every erm subcommand that talks to etcd takes the TLS and auth flags; ermrun turns --ckpt-tls into the
rendezvous setting that makes the checkpoint transport's TLS required."""

from __future__ import annotations

import pytest

from launcher.erm import build_parser
from launcher.ermrun import add_settings_flags
from launcher.ermrun import build_parser as ermrun_parser

SECURITY = ["--etcd-cacert", "ca.pem", "--etcd-cert", "c.pem", "--etcd-key", "c.key", "--etcd-user", "u"]
TALK_TO_ETCD = {  # subcommand -> the least it needs besides the security flags
    "status": ["--endpoint", "h:2379"],
    "top": ["--endpoint", "h:2379"],
    "events": ["--endpoint", "h:2379"],
    "report": ["--endpoint", "h:2379", "run1"],
    "launch": ["--hostfile", "hosts", "train.py"],
    "stop": ["--endpoint", "h:2379", "run1"],
}
# dry runs, the embedded demo, the etcd server itself, and gc (node memory on this machine only)
NO_ETCD = {"plan", "simulate", "demo", "etcd", "gc"}


@pytest.mark.parametrize("command", sorted(TALK_TO_ETCD))
def test_every_subcommand_that_talks_to_etcd_takes_tls_and_auth(command):
    args = build_parser(command).parse_args([command, *SECURITY, *TALK_TO_ETCD[command]])
    found = {
        k: v
        for k, v in vars(args).items()
        if k.endswith(("etcd_cacert", "etcd_cert", "etcd_key", "etcd_user"))
    }
    assert sorted(found.values()) == ["c.key", "c.pem", "ca.pem", "u"] or command == "launch"
    if command == "launch":  # passed on to each host's ermrun as given
        assert args.ermrun_flags[-8:] == SECURITY


def test_the_subcommand_list_is_covered():
    from launcher.erm import SUBCOMMANDS

    assert set(SUBCOMMANDS) == set(TALK_TO_ETCD) | NO_ETCD


def test_ckpt_tls_flag_becomes_the_rendezvous_setting():
    args = ermrun_parser().parse_args(["--ckpt-tls", "required", "--etcd-cacert", "ca.pem", "train.py"])
    add_settings_flags(args)
    assert "ckpt_tls=required" in args.rdzv_conf and "ca_cert=ca.pem" in args.rdzv_conf
    with pytest.raises(SystemExit):
        ermrun_parser().parse_args(["--ckpt-tls", "maybe", "train.py"])
