"""`erm plan JOB.json`: what the planner would do for a job, and why (dry run, no etcd)."""

from __future__ import annotations

import argparse
import json
import math
import sys

HELP = "Show what the resource planner would do for a job description, and why (dry run)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", help="job description JSON (schema: docs/planner.md); '-' reads stdin")
    parser.add_argument("--min-nodes", type=int, help="override the description's min_nodes")
    parser.add_argument("--max-nodes", type=int, help="override the description's max_nodes")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of text")


def run(args: argparse.Namespace) -> int:
    from elastic_rm.planner.config import config_from_job
    from elastic_rm.planner.explain import explain, render

    name = "<stdin>" if args.job == "-" else args.job
    try:
        text = sys.stdin.read() if args.job == "-" else open(args.job).read()
    except OSError as exc:
        print(f"erm plan: {name}: cannot read: {exc.strerror}", file=sys.stderr)
        return 2
    except UnicodeDecodeError:
        print(f"erm plan: {name}: not UTF-8 text", file=sys.stderr)
        return 2
    try:
        desc = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"erm plan: {name}:{exc.lineno}:{exc.colno}: not valid JSON: {exc.msg}", file=sys.stderr)
        return 2
    except (ValueError, RecursionError) as exc:  # a number too long to convert, absurd nesting
        print(f"erm plan: {name}: not usable JSON: {exc}", file=sys.stderr)
        return 2
    if isinstance(desc, dict):
        for key in ("min_nodes", "max_nodes"):
            if getattr(args, key) is not None:
                desc[key] = getattr(args, key)
    try:  # the job's "planner" settings, checked as ermrun --job checks them: the live leader uses them
        cfg = config_from_job(desc, where=f"{name}: planner") if isinstance(desc, dict) else None
        report = explain(desc, cfg, where=name)
    except ValueError as exc:  # a JobSpecError, or a planner setting config_from_job refuses
        print(f"erm plan: {exc}", file=sys.stderr)
        return 2
    try:
        text = json.dumps(_json_safe(report), indent=2, allow_nan=False) if args.json else render(report)
        print(text, flush=True)
    except BrokenPipeError:  # erm plan job.json | head -1
        from .status import reader_gone

        return reader_gone()
    return 0


def _json_safe(value: object) -> object:
    """The report with numpy scalars as Python numbers and a non-finite number as null: json.dumps wrote
    the R^2 of a one-size fit as NaN, which is not JSON (jq, JSON.parse and json.loads(strict) refuse it)."""
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, str | bytes | int | float | bool):
        value = item()  # a numpy scalar
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
