"""ermrun's parser (argparse) takes an unambiguous abbreviation of a flag: ``--cpu 0.5`` is
``--cpu-limit 0.5``. The early spares read the command line by hand; they took ``--cpu`` for some other
flag, started before the node's cgroup existed, and the agent adopted them: the workers ran outside the
node's CPU quota and memory limit. ``--malloc 4`` likewise left every spare and worker at one arena."""

from __future__ import annotations

import pytest

from launcher.early_spares import malloc_arenas, plan
from launcher.ermrun import build_parser


@pytest.mark.parametrize(
    "argv, flag, value",
    [
        (["--nproc-per-node", "2", "--cpu", "0.5", "t.py"], "cpu_limit", 0.5),
        (["--cpu-lim=1", "t.py"], "cpu_limit", 1.0),
        (["--memory", "4G", "t.py"], "memory_limit", "4G"),
        (["--memory-l=4G", "t.py"], "memory_limit", "4G"),
        (["--run-p", "t.py"], "run_path", True),
    ],
)
def test_an_abbreviated_flag_that_rules_out_early_spares_rules_them_out(argv, flag, value):
    assert getattr(build_parser().parse_args(argv), flag) == value  # what ermrun will do
    assert plan(argv, {}) is None


def test_abbreviated_flags_the_early_spares_read_are_read():
    argv = ["--stand", "--nproc-per", "2", "--malloc", "4", "--spare-p", "json", "t.py", "--lr", "1"]
    args = build_parser().parse_args(argv)
    assert (args.standalone, args.nproc_per_node, args.malloc_arenas, args.spare_preload) == (
        True,
        "2",
        4,
        "json",
    )
    assert plan(argv, {}) == (2, ("json",), ("t.py", "--lr", "1"))
    assert malloc_arenas(argv) == 4


def test_other_flags_still_start_early_spares():
    assert plan(["--nproc-per-node", "2", "--max-restarts", "3", "t.py"], {}) == (2, ("torch",), ("t.py",))
