"""What every benchmark shares: where results go, what a results file records, how a table is printed.

Every results file says what produced it (commit, date, machine, command), so that a reader can tell which
code a figure measured and rerun it.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from elastic_rm.proc import kill_tree

REPO = Path(__file__).resolve().parents[1]
RESULTS = str(REPO / "benchmarks" / "results")


def commit(repo: Path = REPO) -> str:
    """HEAD of the checkout, with "-dirty" when tracked files differ from it (the measured code is then
    not exactly that commit); "unknown" outside a git checkout."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30
        )
        if head.returncode != 0:
            return "unknown"
        changed = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if changed.stdout.strip() else "")


def gpus() -> list[str]:
    """Each GPU as nvidia-smi names it, with its memory; empty without an NVIDIA driver."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


LOAD_AT_START = os.getloadavg()  # this module is imported as a benchmark starts, before any work


def machine() -> dict[str, Any]:
    """The machine, with its load average (1, 5, 15 min) as the benchmark started and as it ended."""
    import psutil

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "mem_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "gpus": gpus(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_process_start": LOAD_AT_START,
        "load_avg_when_written": os.getloadavg(),
    }


def command() -> str:
    """The command line as it was typed (interpreter, -m module and arguments)."""
    return shlex.join(getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv])


def provenance() -> dict[str, Any]:
    """What produced a results file: the commit measured, the UTC date, the machine, the command."""
    return {
        "commit": commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "command": command(),
    }


def write_json(path: str | Path, body: dict[str, Any]) -> str:
    """Write atomically (a reader never sees half a file), keys sorted so that reruns diff cleanly."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True, default=_plain) + "\n")
    tmp.replace(path)
    return str(path)


def write_result(name: str, payload: dict[str, Any], results_dir: str = RESULTS) -> str:
    """benchmarks/results/<name>.json: the payload under the benchmark's name and its provenance."""
    body = {"benchmark": name, **payload, **provenance()}
    return write_json(os.path.join(results_dir, f"{name}.json"), body)


def copy_result(source: Path, name: str, results_dir: str = RESULTS) -> str:
    """A run's own results file (``erm demo``'s, the soak's: library code writes into its work directory,
    never into the checkout) copied to benchmarks/results/<name>.json with its provenance. The date is
    the run's, the machine's size and load are merged with what the run recorded."""
    body = json.loads(Path(source).read_text())
    stamp = provenance()
    stamp["machine"] = {**stamp["machine"], **body.get("machine", {})}
    stamp["date"] = body.pop("time", stamp["date"])
    return write_json(os.path.join(results_dir, f"{name}.json"), {**body, **stamp})


def keep_run_result(returncode: int, work: str, name: str, what: str) -> int:
    """After a run that wrote its figures to ``<work>/<name>.json``: copy them into benchmarks/results/ and
    remove the work directory; a failed run leaves the results file as it was and keeps its work directory
    (its logs) for a look. The exit status for the benchmark."""
    figures = Path(work) / f"{name}.json"
    if returncode != 0 or not figures.is_file():
        print(
            f"{what} failed (exit {returncode}): benchmarks/results/{name}.json left as it was; "
            f"its logs are in {work}",
            file=sys.stderr,
        )
        return returncode or 1
    print("wrote", copy_result(figures, name))
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _plain(value: Any) -> Any:
    """A numpy scalar (a simulator's float64, or the bool of comparing one) as the Python value it holds."""
    item = getattr(value, "item", None)
    if callable(item):
        return item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def summarize(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(values), "median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """Stop each process this run started, with its children, by its pid (bounded)."""
    for p in procs:
        kill_tree(p.pid)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            pass


def end_run(procs: list[subprocess.Popen], etcd: Any, run_id: str, workdir: Path | None = None) -> None:
    """After a run of ``ermrun`` nodes: stop them (by pid) and their etcd, free the run's node memory
    (/dev/shm) and, given, its work directory."""
    stop_processes(procs)
    if etcd is not None:
        etcd.stop()
    shutil.rmtree(Path("/dev/shm/elastic-rm") / run_id, ignore_errors=True)
    if workdir is not None:
        shutil.rmtree(workdir, ignore_errors=True)
