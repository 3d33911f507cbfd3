"""`erm gc`: remove the node memory (/dev/shm/elastic-rm/<run>) that crashed runs left on this machine.

Only directories that elastic-rm made (owners.is_node_memory: a claim, or a run's node-memory layout) are
ever removed; anything else under the root is listed and left alone."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

HELP = "Remove node memory that runs with no live owner left on this machine (crashed, killed)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    parser.add_argument("--run", metavar="RUN", help="this run's node memory only (its --rdzv-id)")
    parser.add_argument(
        "--root",
        help="node-memory root (default: $ELASTIC_RM_MEMORY_ROOT, else /dev/shm/elastic-rm)",
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


def run(args: argparse.Namespace) -> int:
    from elastic_rm.checkpoint.node_memory import memory_root
    from elastic_rm.checkpoint.owners import scan

    root = Path(args.root) if args.root else memory_root()
    if args.root and not root.is_dir():
        print(f"erm gc: error: --root {root} is not a directory", file=sys.stderr)
        return 2
    runs = scan(root)
    if args.run is not None:
        runs = [r for r in runs if r.path.name == args.run]
        if not runs:
            print(f"erm gc: no node memory of run {args.run!r} under {root}")
            return 0
    if not runs:
        print(f"erm gc: no node memory under {root}")
        return 0
    freed = 0
    verb = "would remove" if args.dry_run else "removed"
    for r in runs:
        if not r.node_memory:
            print(f"skipped {r.path}: not elastic-rm node memory: left alone")
            continue
        if r.owners:
            pids = ", ".join(map(str, r.owners))
            print(f"kept {r.path} ({_mb(r.bytes)}): in use by pid {pids}")
            continue
        if not args.dry_run:
            shutil.rmtree(r.path, ignore_errors=True)
        freed += r.bytes
        print(f"{verb} {r.path} ({_mb(r.bytes)}): no live owner")
    print(f"erm gc: {verb} {_mb(freed)} in all" + (" (dry run)" if args.dry_run else ""))
    return 0
