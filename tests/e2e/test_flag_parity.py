"""ermrun accepts every torchrun flag with the same meaning; a torch upgrade that adds one fails here."""

from __future__ import annotations

from torch.distributed.run import get_args_parser

from launcher.ermrun import OUR_FLAGS, build_parser

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
