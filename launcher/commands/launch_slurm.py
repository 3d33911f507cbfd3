"""`erm launch --slurm`: the run's nodes are one-node Slurm jobs (logic: elastic_rm.launch.slurm_nodes)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field


def add_slurm_arguments(p: argparse.ArgumentParser, source) -> None:
    """``--slurm`` joins the host sources (``source``: --hostfile, --discovery-script); its options."""
    source.add_argument(
        "--slurm", action="store_true", help="take the nodes from Slurm: one one-node job per node (below)"
    )
    g = p.add_argument_group("slurm", "with --slurm: every node is a one-node Slurm job named erm-<rdzv-id>")
    g.add_argument(
        "--partition", help="Slurm partition(s) of the node jobs, comma-separated (default: Slurm's)"
    )
    g.add_argument(
        "--slurm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="an sbatch option for every node job, e.g. --slurm-arg=--time=4:00:00 --slurm-arg=--gres=gpu:8 "
        "(repeatable)",
    )
    g.add_argument(
        "--exclude",
        default="",
        metavar="HOSTS",
        help="Slurm nodes never to use: comma-separated, or Slurm's host list (b[1-3,5])",
    )
    g.add_argument(
        "--slurm-output",
        metavar="PATTERN",
        help="each node job's output file, in sbatch's --output pattern "
        "(default: WORKDIR/%%x-%%j.out: erm-RUN-JOBID.out)",
    )
    g.add_argument(
        "--pending-report",
        type=float,
        default=60.0,
        metavar="S",
        help="report a node job still pending after S seconds, with Slurm's reason (default 60)",
    )
    g.add_argument(
        "--call-in",
        action="store_true",
        help="when the run started on fewer nodes than it asked for, lend them to a job that arrives later "
        "and would start on them: the nodes it needs stop, and the run asks for nodes again once that job "
        "started (once per run; it may stop all of them, so the checkpoint must outlive the nodes: a "
        "durable copy, or a progress file)",
    )


def _partitions(slurm, wanted: str | None) -> tuple[str, ...]:
    """The partitions the node jobs go to, checked against sinfo's list before anything is submitted."""
    from elastic_rm.launch.slurm_cli import SlurmError

    names, default = slurm.partitions()
    if not wanted:
        if default is None:
            raise SlurmError(f"Slurm has no default partition; pass --partition (one of {', '.join(names)})")
        return (default,)
    chosen = tuple(x.strip() for x in wanted.split(",") if x.strip())
    unknown = [x for x in chosen if x not in names]
    if unknown:
        raise SlurmError(
            f"Slurm has no partition {', '.join(unknown)} (sinfo lists: {', '.join(names) or 'none'})"
        )
    return chosen


# sbatch options that erm launch sets itself, or that would change what a node job is: refused in --slurm-arg
# (long names; sbatch also takes an unambiguous prefix of one, and the short forms), with what to use
RESERVED_SBATCH = {
    "--job-name": ("-J", "erm launch names its node jobs erm-<rdzv-id> to find them again"),
    "--comment": (None, "erm launch's comment marks the run's node jobs (adoption, growth)"),
    "--partition": ("-p", "use erm launch's --partition"),
    "--exclude": ("-x", "use erm launch's --exclude"),
    "--output": ("-o", "use erm launch's --slurm-output"),
    "--chdir": ("-D", "use erm launch's --workdir"),
    "--nodes": ("-N", "every node job is one node; the run's size is --nnodes"),
    "--array": ("-a", "every node job is one job"),
    "--requeue": (None, "a node job that ends is replaced by erm launch, not requeued by Slurm"),
    "--wrap": (None, "the batch script runs ermrun"),
}


def _sbatch_args(given: list[str]) -> tuple[str, ...]:
    """--slurm-arg as given, or ValueError naming a reserved option and what to use instead."""
    for arg in given:
        name = arg.split("=", 1)[0]
        for option, (short, instead) in RESERVED_SBATCH.items():
            # any prefix: sbatch takes one of any length that is unambiguous (--jo=x renamed the node
            # jobs, --ar=1-3 made each an array of 3; a prefix that is not is refused by sbatch anyway)
            long_form = name.startswith("--") and len(name) > 2 and option.startswith(name)
            if long_form or (short is not None and name.startswith(short) and not name.startswith("--")):
                raise ValueError(f"--slurm-arg={arg}: sbatch's {option} cannot be set here: {instead}")
    return tuple(given)


def _exclude_hosts(text: str) -> tuple[str, ...]:
    """--exclude: host names, comma-separated, each of which may be Slurm's host list (b[1-3,5])."""
    from elastic_rm.launch.slurm import SlurmError as HostListError
    from elastic_rm.launch.slurm import expand_hostlist

    if not text.strip():
        return ()
    try:
        return tuple(h.strip() for h in expand_hostlist(text) if h.strip())
    except HostListError as exc:
        raise ValueError(f"--exclude {text}: {exc}") from None


def _options(args: argparse.Namespace, run_id: str, flags: list[str], script: list[str], ns_job=None):
    from elastic_rm.launch.command import parse_env
    from elastic_rm.launch.slurm_job import SlurmOptions

    env = parse_env(args.env)
    return SlurmOptions(
        run_id=run_id,
        partition=args.partition,
        sbatch_args=_sbatch_args(args.slurm_arg),
        exclude=_exclude_hosts(args.exclude),
        output=args.slurm_output or os.path.join(args.workdir, "%x-%j.out"),
        workdir=args.workdir,
        python=args.python,
        ermrun_flags=tuple(flags),
        script=tuple(script),
        env=tuple(env.items()),
        pending_report_s=args.pending_report,
        requested_nodes=_requested_nodes(ns_job, args.workdir),
        call_in=args.call_in,
    )


def job_file_of(ns: argparse.Namespace) -> str | None:
    """The job description the nodes will read: ermrun's --job, else its --rdzv-conf job_file=."""
    if ns.job:
        return ns.job
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    return _parse_rendezvous_config(ns.rdzv_conf or "").get("job_file") or None


def _requested_nodes(job_file: str | None, workdir: str) -> int | None:
    """The nodes the job description requests, read here as the nodes will (relative to --workdir); None
    when there is none. A job file named but unreadable here is refused (ValueError): without its request,
    every node job past --nnodes' minimum would be growth, held while any other job waits."""
    if not job_file:
        return None
    path = os.path.join(workdir, job_file)
    try:
        with open(path) as fh:
            job = json.load(fh)
    except OSError as exc:
        raise ValueError(
            f"cannot read the job description {path} on this login node ({exc.strerror}): erm launch --slurm "
            "reads its request of nodes before it submits any; give a path the login node and the nodes "
            "both read (relative to --workdir), or fix its permissions"
        ) from None
    except ValueError as exc:
        raise ValueError(
            f"the job description {path} is not JSON ({exc}): fix it, then launch again"
        ) from None
    request = job.get("request", {}) if isinstance(job, dict) else None
    if not isinstance(request, dict):
        raise ValueError(
            f"the job description {path} is not a JSON object with a 'request' object: "
            "fix it, then launch again"
        )
    nodes = request.get("nodes")
    return nodes if isinstance(nodes, int) and nodes > 0 else None


def check_poll_interval(args: argparse.Namespace) -> None:
    from elastic_rm.wire.records import QUEUE_WRITE_EVERY_S

    if args.poll_interval > QUEUE_WRITE_EVERY_S:
        raise ValueError(
            f"--poll-interval {args.poll_interval:g}: with --slurm at most {QUEUE_WRITE_EVERY_S:g}s, the "
            "queue key's refresh (the leader takes a key left unchanged for three of them as written by "
            "a launcher that is gone)"
        )


def check_slurm(args: argparse.Namespace, run_id: str, flags: list[str], script: list[str], job_file=None):
    """Slurm is there, the partitions exist, and sbatch accepts the node job (``--test-only``: nothing
    submitted); SlurmError with Slurm's own words otherwise. Returns (slurm, options, partitions).
    Imports nothing that loads torch: it runs while ermrun's parser loads (launcher.commands.launch)."""
    from elastic_rm.launch.slurm_cli import Slurm

    options = _options(args, run_id, flags, script, job_file)
    slurm = Slurm()
    slurm.check_installed()
    partitions = _partitions(slurm, args.partition)
    slurm.submit(options.sbatch_options([]), options.batch_script(), test_only=True)
    return slurm, options, partitions


@dataclass(frozen=True)
class FirstRead:
    """ermrun's flags that the run's first node jobs depend on, read without ermrun's parser."""

    flags: list[str]  # as typed, with --rdzv-id=<made up> when none was given
    run_id: str
    nnodes: tuple[int, int]
    job_file: str | None


def read_first(flags: list[str]) -> FirstRead | None:
    """The run id, --nnodes and the job description from ermrun's flags as typed, as torchrun's parser
    reads them (its PET_* variables included), without loading it. None when they are not plain, or name
    a rendezvous backend, --standalone, a --node-id or no --rdzv-endpoint (which erm launch refuses or
    leaves to the parser): the parser then reads them and nothing is submitted before it has. The
    parser's reading is compared with this one before the node jobs are kept (launcher.commands.launch)."""
    env = os.environ
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    p.add_argument("--rdzv-id", "--rdzv_id", default=env.get("PET_RDZV_ID", "none"))
    p.add_argument("--nnodes", default=env.get("PET_NNODES", "1:1"))
    p.add_argument("--rdzv-conf", "--rdzv_conf", default=env.get("PET_RDZV_CONF", ""))
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=env.get("PET_RDZV_ENDPOINT", ""))
    p.add_argument("--rdzv-backend", "--rdzv_backend", default=env.get("PET_RDZV_BACKEND"))
    p.add_argument("--standalone", action="store_true", default=bool(env.get("PET_STANDALONE")))
    p.add_argument("--node-id")
    p.add_argument("--job")
    try:
        known, _ = p.parse_known_args(flags)
        if known.rdzv_backend or known.standalone or known.node_id or not known.rdzv_endpoint:
            return None
        low, _, high = known.nnodes.partition(":")
        nnodes = (int(low), int(high or low))
        pairs = (item.split("=", 1) for item in known.rdzv_conf.split(",") if item.strip())
        conf = {key.strip(): value.strip() for key, value in pairs}
    except (argparse.ArgumentError, ValueError):
        return None
    job_file = known.job or conf.get("job_file") or None
    flags = list(flags)
    run_id = known.rdzv_id
    if run_id in ("", "none"):
        run_id = f"job-{uuid.uuid4().hex[:8]}"
        flags.append(f"--rdzv-id={run_id}")
    return FirstRead(flags, run_id, nnodes, job_file)


def check_local(args: argparse.Namespace) -> None:
    """What erm launch builds on this machine before the executor runs: the host pool's settings and the
    events file. Checked before any node job is submitted, so that a bad value leaves none in Slurm's
    queue; ValueError saying what to fix."""
    from elastic_rm.launch.pool import HostPool

    HostPool(args.host_failures, args.blacklist_cooldown, args.max_cooldown)
    if args.events_file:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(args.events_file)), exist_ok=True)
            with open(args.events_file, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ValueError(
                f"--events-file {args.events_file}: cannot open it for appending ({exc.strerror}); "
                "give a path this user can write"
            ) from None


@dataclass
class FirstJobs:
    """The node jobs erm launch submits before ermrun's parser has read the flags."""

    submitted: list[tuple[str, float]] = field(default_factory=list)  # (job id, time submitted)
    before: set[str] | None = None  # the run's jobs Slurm listed before any was submitted (adopted)


def _run_job_ids(slurm, options) -> set[str]:
    """The run's node jobs Slurm lists and that have not ended (by the name and comment erm launch gives)."""
    return {j.job_id for j in slurm.jobs() if options.owns(j.name, j.comment) and not j.ended}


def submit_first(checked, count: int, first: FirstJobs) -> None:
    """The run's first ``count`` node jobs, appended to ``first.submitted``; none when Slurm has node jobs
    of the run already (a restarted erm launch adopts those). Records those jobs in ``first.before``."""
    slurm, options, _ = checked
    first.before = _run_job_ids(slurm, options)
    if not first.before:
        for _ in range(count):
            first.submitted.append(
                (slurm.submit(options.sbatch_options([]), options.batch_script()), time.time())
            )
    # KillWait, read while Slurm answers and ermrun's parser still loads, after the submissions: a stop
    # may come when Slurm does not answer
    slurm.cancel_wait_s()


def cancel_first(checked, first: FirstJobs, grace_s: float, interrupts) -> list[str]:
    """Cancel the first node jobs when erm launch gives up before its executor runs, and any other job of
    the run Slurm lists that was not there before them: an sbatch interrupted or timed out after Slurm took
    its job never returned the id. A job listed before (a restarted erm launch's to adopt) is left. Returns
    what scancel needs to end what squeue may still list (named for the user): job ids, or
    ``--name=erm-<run>`` when Slurm could not list the run's jobs."""
    interrupts.stop()
    slurm, options, _ = checked
    ids = [job_id for job_id, _ in first.submitted]
    listed = first.before is None or _list_new(slurm, options, first, ids, grace_s, interrupts)
    left = cancel_jobs(slurm, ids, grace_s, interrupts)
    if listed:
        return left
    print(
        f"erm launch: a job of the run whose sbatch was interrupted may still be in Slurm: "
        f"scancel --name={options.job_name}",
        file=sys.stderr,
    )
    return [f"--name={options.job_name}"]


def _list_new(slurm, options, first: FirstJobs, ids: list[str], grace_s: float, interrupts) -> bool:
    """Appends to ``ids`` the run's jobs Slurm lists that were not there before the first ones; tries
    again while squeue fails, within the stop's bound (shorter once a signal hurries the stop, none once
    one more asks to leave). False when squeue never answered."""
    from elastic_rm.launch.slurm_cli import SlurmError

    deadline = time.monotonic() + grace_s + slurm.cancel_wait_s()
    hurried = False
    while True:
        try:
            ids += sorted(_run_job_ids(slurm, options) - first.before - set(ids))
            return True
        except SlurmError as exc:
            failure = exc
        if interrupts.hurry and not hurried:
            hurried, deadline = True, min(deadline, time.monotonic() + slurm.cancel_wait_s())
        if interrupts.leave or time.monotonic() >= deadline:
            print(
                f"erm launch: cannot list Slurm's jobs ({failure}): check squeue for jobs named "
                f"{options.job_name}",
                file=sys.stderr,
            )
            return False
        time.sleep(0.5)


def cancel_jobs(slurm, job_ids: list[str], grace_s: float, interrupts) -> list[str]:
    """Stop node jobs as the executor does: a pending one is cancelled, a running one's ermrun gets SIGTERM
    (it leaves and cleans up) and is cancelled after ``grace_s``, or at once when a signal hurries the stop
    (elastic_rm.launch.interrupts). Returns once squeue lists none of them alive, else (bounded, or
    on one more signal, after the hurried scancel) the ids left, which it names with the scancel command."""
    from elastic_rm.launch.slurm_cli import SlurmError

    if not job_ids:
        return []
    print(
        f"erm launch: stopping Slurm job(s) {' '.join(job_ids)}: SIGTERM to their ermrun, scancel after "
        f"--stop-grace {grace_s:g}s",
        file=sys.stderr,
    )
    now = time.monotonic()
    cancel_at, deadline = now + grace_s, now + grace_s + slurm.cancel_wait_s()
    signalled: set[str] = set()
    cancelled = hurried = False
    alive: list | None = None
    while time.monotonic() < deadline:
        try:
            alive = [j for j in slurm.jobs() if j.job_id in job_ids and not j.ended]
        except SlurmError:
            alive = None
        if alive == []:
            return []
        for job in alive or ():
            if interrupts.hurry:
                break  # scancel of them all, below
            try:
                if job.state == "PENDING":
                    slurm.cancel(job.job_id)
                elif job.job_id not in signalled:
                    slurm.signal(job.job_id, "TERM")
                    signalled.add(job.job_id)  # once: a second SIGTERM would cut ermrun's cleanup short
            except SlurmError:
                pass  # e.g. its batch step is not there yet: again at the next look
        if interrupts.hurry and not hurried:
            hurried = True
            cancel_at = time.monotonic()
            deadline = cancel_at + slurm.cancel_wait_s()
        if alive is None or (not cancelled and time.monotonic() >= cancel_at):
            if not cancelled:
                print(f"erm launch: cancelling Slurm job(s) {' '.join(job_ids)} (scancel)", file=sys.stderr)
            cancelled = True
            try:
                slurm.cancel(*job_ids)
            except SlurmError as exc:
                print(f"erm launch: scancel {' '.join(job_ids)} failed: {exc}", file=sys.stderr)
        if interrupts.leave:
            break
        time.sleep(0.2)
    left = [j.job_id for j in alive] if alive is not None else list(job_ids)
    print(
        f"erm launch: Slurm may still list job(s) {' '.join(left)}: scancel {' '.join(left)}", file=sys.stderr
    )
    return left


def execute_slurm(args, ns, settings, checked, nnodes, client, interrupts, first=()) -> int:
    """Run the Slurm executor until the job ends (or Ctrl-C, SIGTERM: every node job is stopped; see
    elastic_rm.launch.interrupts for a second signal); ``first``: the node jobs submitted before it,
    as (job id, time submitted). ``interrupts``: erm launch's signal handlers, entered by the caller."""
    from elastic_rm.launch.executor import ExecutorConfig
    from elastic_rm.launch.pool import HostPool
    from elastic_rm.launch.slurm_cli import SlurmError
    from elastic_rm.launch.slurm_nodes import SlurmExecutor
    from elastic_rm.obs.events import EventLog

    slurm, options, partitions = checked
    run_id, keys = ns.rdzv_id, settings.keys
    lock = threading.Lock()

    def say(message: str) -> None:
        with lock, contextlib.suppress(OSError):  # a terminal gone (SIGHUP) must not break the stop
            sys.stderr.write(f"[erm launch] {message}\n")
            sys.stderr.flush()

    events = EventLog(run_id, "erm-launch", path=args.events_file, client=client, keys=keys)
    config = ExecutorConfig(
        nnodes[0],
        nnodes[1],
        poll_s=args.poll_interval,
        stop_grace_s=args.stop_grace,
        exit_grace_s=args.exit_grace,
        idle_timeout_s=args.idle_timeout,
    )
    pool = HostPool(args.host_failures, args.blacklist_cooldown, args.max_cooldown)
    executor = SlurmExecutor(
        client, keys, pool, slurm, options, events, config, say, partitions=partitions, interrupts=interrupts
    )
    try:
        try:
            adopted = executor.adopt(first)
        except SlurmError as exc:
            say(f"cannot list Slurm's jobs: {exc}")
            executor.stop_all("erm launch cannot list Slurm's jobs")
            return 2
        say(
            f"run {run_id}: Slurm partition(s) {','.join(partitions)}, {nnodes[0]}-{nnodes[1]} node(s), "
            f"etcd {ns.rdzv_endpoint}; node jobs are named {options.job_name}"
            + (f"; adopted {len(adopted)} job(s) of the run: {', '.join(adopted)}" if adopted else "")
        )
        events.emit(
            "launch",
            f"erm launch --slurm started run {run_id}",
            action="begin",
            slurm=True,
            partitions=list(partitions),
            adopted=adopted[:64],  # an event past 16 KiB is refused (ValueError): the first job ids
            adopted_count=len(adopted),
            min_nodes=nnodes[0],
            max_nodes=nnodes[1],
        )
        return executor.run()
    except KeyboardInterrupt:
        # the first node jobs, if before the executor ran; else what the executor's own stop left
        if not executor.stop_all("erm launch was interrupted"):  # else it named the jobs left
            say("interrupted: every node job was stopped (Slurm lists none of them any more)")
        return 130
    finally:
        interrupts.stop()
        events.flush()
        events.close()
        client.close()
