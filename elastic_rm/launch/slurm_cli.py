"""Slurm's command-line tools as `erm launch --slurm` uses them: sbatch, squeue, scancel, sinfo, scontrol.

Only the client commands, never Slurm's REST API or its libraries: they work from any login node with the
user's own rights. ``squeue --json`` is parsed whole (Slurm 22.05 ignores squeue's filters with --json), so
one call per poll gives both this run's node jobs and the partition's queue.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass

TOOLS = ("sbatch", "squeue", "scancel", "sinfo")
ENDED = frozenset(
    {
        "COMPLETED",
        "FAILED",
        "CANCELLED",
        "NODE_FAIL",
        "TIMEOUT",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "BOOT_FAIL",
        "DEADLINE",
        "REVOKED",
        "SPECIAL_EXIT",
    }
)
NODE_LOST = frozenset({"NODE_FAIL", "BOOT_FAIL", "CANCELLED", "PREEMPTED"})  # the node, not ermrun, ended it
BAD_NODE_STATES = ("down", "drain", "fail")  # sinfo's %T: down, down*, drained, draining, failing...
# Slurm's default KillWait: scancel's SIGTERM, then SIGKILL this long after (a job whose processes ignore
# SIGTERM lives that long); used where scontrol cannot say the cluster's own
KILL_WAIT_DEFAULT_S = 30.0
# after scancel, how much longer than KillWait a stop waits for squeue to list none of the cancelled jobs
# (the epilog, the controller noting the end)
AFTER_KILL_WAIT_S = 10.0


class SlurmError(RuntimeError):
    """A Slurm command is missing, failed, or printed what we cannot read; says which and Slurm's words."""


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    name: str
    comment: str
    state: str  # PENDING, RUNNING, COMPLETING, COMPLETED, FAILED, NODE_FAIL...
    nodes: str  # where it runs (empty while pending)
    reason: str  # why it is pending (Resources, Priority...) or why it ended
    partitions: tuple[str, ...]
    node_count: int
    user: str
    exit_code: int | None
    # a pending job array is one record for all its pending tasks: how many of them may wait at once
    array_tasks: int = 1

    @property
    def ended(self) -> bool:
        return self.state in ENDED


def _exit_code(value) -> int | None:
    """squeue's exit code: a wait status in 22.05 (the code in its high byte), an object in later releases,
    where a job ended by a signal has return code 0 and its signal beside it: 128 + the signal then, as a
    shell says it (a SIGKILLed ermrun is no success)."""
    if isinstance(value, dict):
        signal = value.get("signal", {})
        signal = signal.get("id", {}) if isinstance(signal, dict) else {}
        signal = signal.get("number", 0) if isinstance(signal, dict) else signal
        if "SIGNALED" in (value.get("status") or []) and signal:
            return 128 + int(signal)
        number = value.get("return_code", {})
        return number.get("number") if isinstance(number, dict) else number
    if isinstance(value, int):
        return value >> 8 if value > 255 else value
    return None


def _text(value) -> str:
    if isinstance(value, list):  # later releases give states and reasons as lists
        return ",".join(str(v) for v in value)
    return "" if value is None else str(value)


def _state(value) -> str:
    """The job's base state. Later releases give a list: the base state first, then flags (["PENDING",
    "REQUEUED"], ["RUNNING", "COMPLETING"]); a flag is not the state."""
    if isinstance(value, list):
        value = value[0] if value else ""
    return _text(value).upper()


def _count(value) -> int:
    if isinstance(value, dict):  # {"set": true, "number": N} in later releases
        value = value.get("number", 0)
    return int(value or 0)


def _array_tasks(text: str) -> int:
    """The tasks of a pending job array's record (``1-6``, ``1,3,5-9:2``), at most its throttle (``%2``:
    two run at once); 1 for a job that is no array, or a string this code does not read."""
    spec, _, throttle = text.partition("%")
    count = 0
    try:
        for part in filter(None, spec.split(",")):
            span, _, step = part.partition(":")
            first, _, last = span.partition("-")
            count += (int(last or first) - int(first)) // int(step or 1) + 1
        if throttle:
            count = min(count, int(throttle))
    except ValueError:
        return 1
    return max(count, 1)


def _reason(reason: str, description: str) -> str:
    """The pending reason, with its details when squeue's description carries them: ``ReqNodeNotAvail``'s
    description names the unavailable nodes (``ReqNodeNotAvail, UnavailableNodes:b1``)."""
    return description if reason and description.startswith(reason + ",") else reason


def parse_jobs(text: str) -> list[SlurmJob]:
    """``squeue --json``'s jobs. SlurmError when it is not squeue's JSON."""
    try:
        jobs = json.loads(text)["jobs"]
        return [
            SlurmJob(
                job_id=str(j["job_id"]),
                name=_text(j.get("name")),
                comment=_text(j.get("comment")),
                state=_state(j.get("job_state")),
                nodes=_text(j.get("nodes")),
                reason=_reason(_text(j.get("state_reason")), _text(j.get("state_description"))),
                partitions=tuple(p for p in _text(j.get("partition")).split(",") if p),
                node_count=_count(j.get("node_count")),
                user=_text(j.get("user_name")),
                exit_code=_exit_code(j.get("exit_code")),
                array_tasks=_array_tasks(_text(j.get("array_task_string"))),
            )
            for j in jobs
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise SlurmError(f"squeue --json printed something other than its job list ({exc})") from None


class Slurm:
    """The commands, each bounded by ``timeout_s``; ``env`` is the environment they run in (SLURM_CONF...)."""

    def __init__(self, env: dict[str, str] | None = None, timeout_s: float = 30.0):
        self.env = env
        self.timeout_s = timeout_s
        self._kill_wait_s: float | None = None

    def _run(self, argv: list[str], stdin: str | None = None) -> str:
        """A session of its own: a terminal's Ctrl-C goes to erm launch's process group, and would kill the
        squeue or scancel that its stop runs; an sbatch that erm launch itself gives up on (interrupted, or
        past ``timeout_s``) is killed by subprocess.run."""
        try:
            r = subprocess.run(
                argv,
                input=stdin,
                capture_output=True,
                text=True,
                # squeue prints every user's job names and comments as their bytes: one that is not UTF-8
                # (Latin-1 "caf\xe9") raised UnicodeDecodeError, which no caller expects, at every read
                errors="replace",
                timeout=self.timeout_s,
                env=self.env,
                stdin=None if stdin is not None else subprocess.DEVNULL,
                start_new_session=True,
            )
        except FileNotFoundError:
            raise SlurmError(
                f"{argv[0]} is not on PATH: run erm launch --slurm on a Slurm login node"
            ) from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{' '.join(argv[:2])} did not answer within {self.timeout_s:g}s") from None
        if r.returncode != 0:
            said = (r.stderr.strip() or r.stdout.strip() or "no output")[-600:]
            raise SlurmError(f"{argv[0]} failed (exit {r.returncode}): {said}")
        return r.stdout

    def check_installed(self) -> None:
        path = (self.env or {}).get("PATH") if self.env else None
        missing = [t for t in TOOLS if shutil.which(t, path=path) is None]
        if missing:
            raise SlurmError(
                f"Slurm's {', '.join(missing)} not on PATH: run erm launch --slurm where Slurm's client "
                "commands work (a login node), or without --slurm on your own hosts (--hostfile)"
            )

    def partitions(self) -> tuple[list[str], str | None]:
        """Every partition's name and the default one (sinfo marks it with ``*``)."""
        names, default = [], None
        # --all: a hidden partition (Hidden=YES) the user may submit to is still one
        for line in self._run(["sinfo", "--all", "-h", "-o", "%P"]).split():
            name = line.rstrip("*")
            if line.endswith("*"):
                default = name
            if name not in names:
                names.append(name)
        return names, default

    def submit(self, options: list[str], script: str, test_only: bool = False) -> str:
        """``sbatch --parsable OPTIONS`` with the script on its input; the job id (or, with ``test_only``,
        Slurm's answer to ``--test-only``: the job is checked, not submitted)."""
        argv = ["sbatch", "--test-only", *options] if test_only else ["sbatch", "--parsable", *options]
        try:
            out = self._run(argv, stdin=script).strip()
        except SlurmError as exc:
            raise SlurmError(f"Slurm refuses the node job: {exc}") from None
        if test_only:
            return out
        job_id = out.split(";")[0]
        if not job_id.isdigit():
            raise SlurmError(f"sbatch --parsable printed {out!r}, not a job id")
        return job_id

    def jobs(self) -> list[SlurmJob]:
        return parse_jobs(self._run(["squeue", "--json"]))

    def signal(self, job_id: str, sig: str = "TERM") -> None:
        """The signal to the batch script only (ermrun: the batch script execs it); the job ends with it."""
        self._run(["scancel", "--batch", f"--signal={sig}", job_id])

    def cancel(self, *job_ids: str) -> None:
        if job_ids:
            self._run(["scancel", *job_ids])

    def set_start(self, job_id: str, when: str) -> None:
        """A pending job's earliest start (``now+120``, ``now``), which its owner may change: unlike a
        hold, it keeps the job's priority, so the job keeps its place in the queue."""
        self._run(["scontrol", "update", f"JobId={job_id}", f"StartTime={when}"])

    def cancel_wait_s(self) -> float:
        """How long after scancel a stop waits for its jobs to leave squeue: the cluster's KillWait
        (``scontrol show config``, read once; Slurm's default where scontrol cannot say) plus
        AFTER_KILL_WAIT_S."""
        if self._kill_wait_s is None:
            try:
                found = re.search(r"^KillWait\s*=\s*(\d+)", self._run(["scontrol", "show", "config"]), re.M)
            except SlurmError:
                found = None
            self._kill_wait_s = float(found.group(1)) if found else KILL_WAIT_DEFAULT_S
        return self._kill_wait_s + AFTER_KILL_WAIT_S

    def node_partitions(self) -> dict[str, frozenset[str]]:
        """Node name -> the partitions it is in (hidden ones too: sinfo's --all, which -p excludes)."""
        out: dict[str, set[str]] = {}
        for line in self._run(["sinfo", "--all", "-h", "-N", "-o", "%N %P"]).splitlines():
            parts = line.split()
            if len(parts) == 2:
                out.setdefault(parts[0], set()).add(parts[1].rstrip("*"))
        return {node: frozenset(partitions) for node, partitions in out.items()}

    def node_states(self) -> dict[str, str]:
        """Node name -> sinfo's state (idle, allocated, down*, drained, draining...)."""
        out = {}
        for line in self._run(["sinfo", "-h", "-N", "-o", "%N %T"]).splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = parts[1].lower()
        return out
