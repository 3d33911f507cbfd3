"""The hostfile format: what each form means, and errors that name the line."""

from __future__ import annotations

import pytest

from elastic_rm.launch.hostfile import HostfileError, parse_hosts, read_hostfile

GOOD = """\
# a comment, then a blank line

gpu01 slots=8 gpu=a100 rack=r1   # trailing comment
gpu02:2222
alice@gpu03
n1 addr=10.0.0.7 port=22 user=bob
n2 addr=10.0.0.7
"""


def test_every_documented_form():
    hosts = {h.name: h for h in parse_hosts(GOOD, "hostfile h")}
    assert list(hosts) == ["gpu01", "gpu02-2222", "gpu03", "n1", "n2"]
    g1 = hosts["gpu01"]
    assert (g1.addr, g1.port, g1.user, g1.slots, g1.labels) == (
        "gpu01",
        None,
        None,
        8,
        {"gpu": "a100", "rack": "r1"},
    )
    assert (hosts["gpu02-2222"].addr, hosts["gpu02-2222"].port) == ("gpu02", 2222)
    assert (hosts["gpu03"].addr, hosts["gpu03"].user) == ("gpu03", "alice")
    assert (hosts["n1"].addr, hosts["n1"].port, hosts["n1"].user) == ("10.0.0.7", 22, "bob")
    assert hosts["n2"].addr == "10.0.0.7" and hosts["n2"].node_id == "n2"
    assert hosts["n1"].where() == "bob@10.0.0.7:22"


@pytest.mark.parametrize(
    "line,problem",
    [
        ("gpu01 slots=zero", "slots=zero must be a whole number"),
        ("gpu01 slots", "'slots' is not key=value"),
        ("gpu01:99999", "port '99999'"),
        ("slots=2", "must start with a host name"),
        ("gpu/01", "address 'gpu/01' is not a host name"),
        ("fe80::1", "invalid host name"),  # an IPv6 address needs the alias form
        ("gpu01 addr=bad/host", "address 'bad/host'"),
        ("gpu01 1gpu=x", "label name '1gpu'"),
        ("gpu01", "repeats line 1"),
    ],
)
def test_a_malformed_line_is_an_error_naming_the_line(line, problem):
    with pytest.raises(HostfileError) as err:
        parse_hosts(f"gpu01\n{line}\n", "hostfile hosts.txt")
    assert "hostfile hosts.txt, line 2" in str(err.value)
    assert problem in str(err.value)


def test_a_hostfile_without_hosts_or_unreadable_is_an_error(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(HostfileError, match="names no host"):
        read_hostfile(str(empty))
    with pytest.raises(HostfileError, match="cannot be read"):
        read_hostfile(str(tmp_path / "missing"))
