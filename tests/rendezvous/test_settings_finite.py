"""A non-finite number (nan, inf) in --rdzv-conf, or as an etcd client's timeout, is refused with the key
named: nan passes every `<=` check and ended as "etcd did not answer within nans" or "cannot convert
float NaN to integer"."""

from __future__ import annotations

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.etcd.errors import EtcdConfigError
from elastic_rm.rendezvous.settings import RendezvousSettings
from tests.e2e.helpers import ermrun_here


def settings(**conf) -> RendezvousSettings:
    return RendezvousSettings.from_parameters(
        RendezvousParameters("elastic-rm", "127.0.0.1:2379", "run", 1, 2, **conf)
    )


KEYS = ["etcd_timeout", "lease_ttl", "join_timeout", "timeout", "last_call_timeout", "peer_probe", "nproc"]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
def test_a_non_finite_rdzv_conf_number_is_refused_by_name(key, value):
    with pytest.raises(ValueError, match=f"--rdzv-conf {key}='{value}' must be a finite number"):
        settings(**{key: value})


def test_a_timeout_that_is_not_a_number_names_its_key():
    with pytest.raises(ValueError, match="--rdzv-conf timeout='soon' is not a number"):
        settings(timeout="soon")


@pytest.mark.parametrize("timeout", [float("nan"), float("inf")])
def test_an_etcd_client_refuses_a_timeout_that_is_no_number_of_seconds(timeout):
    with pytest.raises(
        EtcdConfigError, match=r"etcd timeout must be > 0 seconds \(a finite number\), got (nan|inf)"
    ):
        EtcdClient("127.0.0.1:1", timeout=timeout)


# in this process (ermrun_here: no ~5 s torch import each), so every key's refusal reaches ermrun's message
@pytest.mark.parametrize("conf", ["etcd_timeout=nan", "lease_ttl=nan"])
def test_ermrun_refuses_a_non_finite_rdzv_conf_number_at_once(conf, capfd):
    argv = ["--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x", "--nnodes", "1"]
    assert ermrun_here([*argv, "--rdzv-conf", conf, "/bin/true"]) == 2
    err = capfd.readouterr().err
    key = conf.split("=")[0]
    assert f"--rdzv-conf {key}='nan' must be a finite number" in err, err[-2000:]
    assert "did not answer" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["status", "--endpoint", "127.0.0.1:9", "--timeout", "nan"],
        ["events", "--endpoint", "127.0.0.1:9", "--timeout", "inf"],
        ["report", "r", "--endpoint", "127.0.0.1:9", "--timeout", "-1"],
        ["stop", "r", "--endpoint", "127.0.0.1:9", "--timeout", "0"],
        ["demo", "--hold", "nan"],
        ["demo", "--phase-timeout", "inf"],
    ],
)
def test_a_seconds_flag_that_is_no_finite_positive_number_is_named_by_the_parser(argv, capsys):
    from launcher.erm import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    flag = argv[-2]
    assert exit_.value.code == 2
    assert f"argument {flag}: '{argv[-1]}': a finite number of seconds > 0" in capsys.readouterr().err
