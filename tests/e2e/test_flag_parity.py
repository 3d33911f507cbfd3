"""ermrun accepts every torchrun flag with the same meaning; a torch upgrade that adds one fails here."""

from __future__ import annotations

import subprocess
import sys

import pytest
from torch.distributed.run import get_args_parser

from launcher.ermrun import OUR_FLAGS, build_parser
from launcher.ermrun_options import ERMRUN_OPTIONS
from tests.conftest import REPO

# Meaning we change on purpose, and why (README, "Use it like torchrun").
CHANGED_DEFAULTS = {"rdzv_backend": ("static", "elastic-rm")}


def kind(t):
    """A converter's identity: torch builds some as local functions, new for every parser."""
    return getattr(t, "__qualname__", t)


def actions(parser):
    return {a.dest: a for a in parser._actions if a.dest != "help"}


def test_every_torchrun_flag_keeps_its_meaning():
    torch_actions, ours = actions(get_args_parser()), actions(build_parser())
    missing = set(torch_actions) - set(ours)
    assert not missing, f"torchrun flags missing from ermrun: {sorted(missing)}"
    for dest, theirs in torch_actions.items():
        mine = ours[dest]
        assert mine.option_strings == theirs.option_strings, dest
        assert (kind(mine.type), mine.choices, mine.nargs, mine.const) == (
            kind(theirs.type),
            theirs.choices,
            theirs.nargs,
            theirs.const,
        ), dest
        assert type(mine) is type(theirs), dest  # the same action class: env-var fallback included
        if dest in CHANGED_DEFAULTS:
            assert (theirs.default, mine.default) == CHANGED_DEFAULTS[dest]
        else:
            assert mine.default == theirs.default, dest


def test_our_flags_do_not_shadow_torchrun_and_are_grouped():
    torch_dests = set(actions(get_args_parser()))
    assert not torch_dests & set(OUR_FLAGS)
    help_text = build_parser().format_help()  # what `ermrun --help` prints, without a process of its own
    assert "elastic-rm:" in help_text and "--node-id" in help_text and "--nproc-per-node" in help_text


def test_pet_environment_variables_work_as_in_torchrun(monkeypatch):
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_NNODES", "1:4")
    args = build_parser().parse_args(["train.py"])
    assert args.nproc_per_node == "3" and args.nnodes == "1:4"


def test_erm_launchs_table_of_ermrun_options_matches_ermruns_parser():
    """erm launch tells ermrun's flags and their values apart by this table, without loading torch."""
    parsed = {
        tuple(a.option_strings): a.nargs != 0
        for a in build_parser()._actions
        if a.option_strings and a.dest != "help"
    }
    assert dict(ERMRUN_OPTIONS) == parsed


def test_erm_launch_reads_its_command_line_and_checks_slurm_without_loading_torch():
    """What erm launch --slurm does before its first node job is submitted (its parser, the first read of
    ermrun's flags, the Slurm modules) loads no torch: ermrun's parser loads it meanwhile, in a thread."""
    code = (
        "import sys\n"
        "from launcher.erm import build_parser\n"
        "from launcher.commands.launch_slurm import read_first\n"
        "import elastic_rm.launch.slurm_cli, elastic_rm.launch.slurm_job, elastic_rm.launch.command\n"
        "args = build_parser('launch').parse_args(['launch', '--slurm', '--nnodes', '1:4', "
        "'--rdzv-endpoint', 'h:2379', '--max-restarts', '3', 'train.py', '--lr', '0.1'])\n"
        "assert read_first(args.ermrun_flags).nnodes == (1, 4)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", r.stdout


@pytest.mark.parametrize(
    "argv, env",
    [
        (["--rdzv-endpoint", "h:1", "--nnodes", "2:4", "--rdzv-id", "r1"], {}),
        (["--rdzv_endpoint=h:1", "--nnodes=3", "--rdzv_id", "r1", "--job", "j.json"], {}),
        (["--rdzv-conf", "lease_ttl=2, job_file = j.json", "--rdzv-i", "r1", "--rdzv-e", "h:1"], {}),
        (
            ["--rdzv-conf=job_file=a.json", "--job", "b.json", "--nnodes", "1", "--nnodes", "2:5"],
            {"PET_RDZV_ENDPOINT": "h:1"},
        ),
        (
            [],
            {
                "PET_NNODES": "1:3",
                "PET_RDZV_ID": "from-env",
                "PET_RDZV_CONF": "job_file=e.json",
                "PET_RDZV_ENDPOINT": "h:1",
            },
        ),
        (["--rdzv-endpoint", "h:1", "-m", "--max-restarts", "2"], {}),  # no id: one made up, for both
    ],
)
def test_erm_launchs_first_read_of_the_flags_is_ermruns_parsers(argv, env, monkeypatch):
    """The run id, --nnodes and job description that erm launch --slurm submits its first node jobs with
    are those ermrun's parser reads (erm launch also compares them before it keeps those jobs)."""
    from torch.distributed.run import parse_min_max_nnodes

    from launcher.commands.launch_slurm import job_file_of, read_first
    from launcher.erm import build_parser as erm_parser

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = erm_parser("launch").parse_args(["launch", "--slurm", *argv, "train.py"])
    first = read_first(args.ermrun_flags)
    ns = build_parser().parse_args([*first.flags, "train.py"])
    assert (ns.rdzv_id, parse_min_max_nnodes(ns.nnodes), job_file_of(ns)) == (
        first.run_id,
        first.nnodes,
        first.job_file,
    )
    assert first.run_id not in ("", "none")


def test_flags_erm_launch_cannot_read_first_are_left_to_ermruns_parser():
    from launcher.commands.launch_slurm import read_first

    assert read_first(["--nnodes", "two"]) is None
    assert read_first(["--rdzv-conf", "job_file"]) is None  # no '=': the parser's error, not a guess
    assert read_first(["--rdzv-endpoint", "h:1", "--rdzv-backend", "c10d"]) is None  # refused, or torch's
    assert read_first(["--rdzv-endpoint", "h:1", "--standalone"]) is None
    assert read_first(["--rdzv-endpoint", "h:1", "--node-id", "a"]) is None
    assert read_first(["--nnodes", "2"]) is None  # no etcd named: refused by erm launch
