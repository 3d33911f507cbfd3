"""`erm`: operations on elastic-rm jobs. Each subcommand lives in launcher/commands/<name>.py and exposes
``HELP`` (one line), ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys

SUBCOMMANDS = (
    "etcd",
    "status",
    "top",
    "events",
    "plan",
    "simulate",
    "demo",
    "report",
    "launch",
    "stop",
    "gc",
)


def _load(name: str):
    return importlib.import_module(f"launcher.commands.{name}")


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """All subcommands; with ``only``, the arguments of that one alone (a subcommand's arguments may need
    imports that the others should not pay for)."""
    parser = argparse.ArgumentParser(prog="erm", description="Operate elastic-rm jobs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        try:
            module = _load(name)
        except ModuleNotFoundError as exc:
            if exc.name != f"launcher.commands.{name}":
                raise
            continue
        command = sub.add_parser(name, help=module.HELP, description=module.HELP)
        if only is None or name == only:
            module.add_arguments(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(chosen if chosen in SUBCOMMANDS else None)
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    return int(_load(args.command).run(args) or 0)


def console() -> None:
    """The `erm` command: main(), then the process ends at once, without tearing the interpreter down.
    A subcommand returns once its work is done and its output written (erm launch: every node stopped,
    the events flushed, the etcd client closed); the teardown of the modules it loaded (torch, for
    ermrun's parser) is about a second of CPU that a script waiting for erm launch would otherwise wait
    out after the run's last node is gone, several on a busy login node. An exception ends the usual way."""
    rc = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError):  # a reader gone (erm status | head): nothing to write to
            stream.flush()
    os._exit(rc)


if __name__ == "__main__":
    console()
