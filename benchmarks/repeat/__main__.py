"""``python -m benchmarks.repeat`` (``make test-repeat``): run the suite N times and say what failed.

Why: a flake shows in one run of many, and mostly on a loaded machine; one green run says little. Each
run is a fresh clone (run.py), so nothing of an earlier run or of the working tree leaks in. The results
file (runs, failures per test, wall time per run, commit, date, machine, command) goes to the work
directory, and to benchmarks/results/ only when ``--results NAME`` asks for it.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks.common import REPO, RESULTS, provenance, write_json

from .run import RunSettings, run_once


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.repeat", description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=1, help="how many runs (default 1)")
    p.add_argument(
        "--hog", type=int, default=0, metavar="K", help="beside `stress-ng --cpu K` (default 0: none)"
    )
    p.add_argument(
        "--random", action="store_true", help="a random test order (pytest-randomly), seed printed"
    )
    p.add_argument("--seed", type=int, help="the first run's seed (the next runs +1 each); implies --random")
    p.add_argument("--pytest-args", default="", help="more pytest arguments, e.g. a test directory")
    p.add_argument(
        "--repo", type=Path, default=REPO, help="the repository whose HEAD is cloned (default: this)"
    )
    p.add_argument(
        "--venv",
        choices=("link", "setup"),
        default="link",
        help="link: a thin venv over --venv-from's packages (default); setup: `make setup` in every clone",
    )
    p.add_argument("--venv-from", type=Path, default=REPO / ".venv", help="the installed venv link builds on")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take (default 3600)")
    p.add_argument(
        "--work-dir", type=Path, help="where logs and results go (default: a new directory in /tmp)"
    )
    p.add_argument("--results", metavar="NAME", help="also write benchmarks/results/NAME.json")
    p.add_argument(
        "--results-dir",
        type=Path,
        default=Path(RESULTS),
        help="where --results goes (default: benchmarks/results)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="keep the runs already in the --results file and add these (runs spread over days)",
    )
    p.add_argument("--keep-clones", action="store_true", help="keep each run's clone (default: removed)")
    args = p.parse_args(argv)
    if args.append and not args.results:
        p.error("--append adds to the results file named by --results NAME: give it")
    if args.runs < 1 or args.hog < 0 or args.timeout <= 0:
        p.error("--runs must be at least 1, --hog at least 0 and --timeout above 0")
    if subprocess.run(["git", "-C", str(args.repo), "rev-parse", "HEAD"], capture_output=True).returncode:
        p.error(f"--repo {args.repo} is not a git repository with a commit")
    if args.venv == "link" and not (args.venv_from / "bin" / "python").exists():
        p.error(
            f"--venv-from {args.venv_from} has no bin/python: run `make setup` first, or use --venv setup"
        )
    if args.hog and shutil.which("stress-ng") is None:
        p.error("--hog needs stress-ng on the PATH (Debian/Ubuntu: apt-get install stress-ng)")
    return args


def seeds(args: argparse.Namespace) -> list[int | None]:
    if args.seed is not None:
        return [args.seed + i for i in range(args.runs)]
    if args.random:
        return [random.randrange(2**31) for _ in range(args.runs)]
    return [None] * args.runs


def replay(args: argparse.Namespace, seed: int | None) -> str:
    """The command that runs the same order again in this checkout."""
    parts = [args.pytest_args] + ([f"-p randomly --randomly-seed={seed}"] if seed is not None else [])
    joined = " ".join(p for p in parts if p)
    return f"make test PYTEST_ARGS='{joined}'" if joined else "make test"


def earlier_runs(path: Path) -> list[dict]:
    """The runs of an existing results file that ``--append`` adds to ([] when there is none yet)."""
    if not path.exists():
        return []
    try:
        body = json.loads(path.read_text())
    except ValueError as e:
        raise SystemExit(f"{path} is not JSON ({e}): move it away or drop --append") from None
    runs = body.get("runs") if isinstance(body, dict) else None
    if not isinstance(runs, list) or body.get("benchmark") != "repeat":
        raise SystemExit(f"{path} is not a repeat harness results file: choose another --results NAME")
    return runs


def condition(run: dict) -> str:
    """What a run stood for: the whole suite or a part, idle or beside a hog, fixed or random order."""
    scope = "part" if run.get("pytest_args") else "suite"
    load = f"hog{run['hog_cpus']}" if run["hog_cpus"] else "idle"
    order = "random" if run["seed"] is not None else "fixed"
    return f"{scope}-{load}-{order}"


def summary(args: argparse.Namespace, runs: list[dict]) -> dict:
    per_test = Counter(f["test"] for run in runs for f in run["failures"])
    passed = Counter(condition(run) for run in runs if not run["failures"])
    return {
        "benchmark": "repeat",
        "settings": {
            "runs": args.runs,
            "hog_cpus": args.hog,
            "random_order": args.random or args.seed is not None,
            "pytest_args": args.pytest_args,
            "venv": args.venv,
            "timeout_s": args.timeout,
        },
        "runs_total": len(runs),
        "runs_failed": sum(1 for run in runs if run["failures"]),
        "runs_passed_by_condition": dict(sorted(passed.items())),
        "commits": sorted({run["commit"] for run in runs}),
        "failures_per_test": dict(sorted(per_test.items())),
        "wall_s": [run["wall_s"] for run in runs],
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="erm-repeat-", dir="/tmp"))
    work.mkdir(parents=True, exist_ok=True)
    venv = args.venv_from.resolve() if args.venv == "link" else None
    settings = RunSettings(
        args.repo.resolve(), venv, args.pytest_args, args.hog, args.timeout, args.keep_clones
    )
    print(f"work directory: {work}", flush=True)
    results = args.results_dir / f"{args.results}.json" if args.results else None
    earlier = earlier_runs(results) if args.append and results else []
    runs = []
    for index, seed in enumerate(seeds(args), 1):
        order = f"random order, seed {seed}" if seed is not None else "fixed order"
        print(f"run {index}/{args.runs}: {order}, hog {args.hog} CPU(s)", flush=True)
        run = run_once(index, settings, seed, work)
        runs.append(run)
        verdict = "FAILED" if run["failures"] else "passed"
        print(
            f"run {index}: {verdict} in {run['wall_s']:.0f} s, {run['counts']}, log {run['log']}", flush=True
        )
        if run["slowest"]:
            print(
                "  slowest: " + ", ".join(f"{test} {s:.0f} s" for test, s in run["slowest"][:5]), flush=True
            )
        if run["files"]:
            where = sorted({str(Path(path).parent) for path in run["files"].values()})
            print(f"  the files of the slowest and the failed tests: {', '.join(where)}")
        for f in run["failures"]:
            load = ", ".join(f"{x:.2f}" for x in f["load_avg"])
            print(f"  FAILED {f['test']} ({f['when']}), seed {seed}, load {load}: {f['message']}")
        if run["failures"]:
            print(f"  replay: {replay(args, seed)}", flush=True)
    body = {**provenance(), **summary(args, runs), "commit": runs[0]["commit"]}
    print(f"results: {write_json(work / 'repeat.json', body)}")
    failed = body["runs_failed"]
    print(f"{len(runs) - failed} of {len(runs)} run(s) passed")
    if results:
        merged = earlier + [{**run, "index": len(earlier) + run["index"]} for run in runs]
        everything = {**provenance(), **summary(args, merged), "commit": runs[-1]["commit"]}
        print(f"results: {write_json(results, everything)}")
        by_condition = everything["runs_passed_by_condition"]
        print(f"passed, with the earlier runs of {results.name}, by condition: {by_condition}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
