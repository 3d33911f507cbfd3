"""`erm launch`: run a job's nodes on bare-metal hosts over ssh; the logic is elastic_rm.launch."""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
import threading
import time

from launcher.commands import launch_plan

HELP = "Start a job's nodes (ermrun) on hosts over ssh and keep as many running as the job wants."

EPILOG = """\
Every ermrun flag (see `ermrun --help`) is accepted after the options above and handed to each host's
ermrun, followed by the node's own --node-id (its hostfile name) and, with slots=N, --nproc-per-node N.
Example:
  erm launch --hostfile hosts --ssh-identity ~/.ssh/id_ed25519 --env NCCL_DEBUG \\
      --nnodes 2:8 --nproc-per-node 8 --rdzv-endpoint etcd1:2379 --rdzv-id job1 train.py --lr 0.1
Hostfile format, discovery scripts, and what happens on a failure: docs/launch.md."""


class _ErmrunFlag(argparse.Action):
    """Keeps an ermrun flag exactly as typed, to pass it on to every host's ermrun."""

    def __call__(self, parser, namespace, values, option_string=None):
        flags = list(getattr(namespace, "ermrun_flags", []))
        if self.nargs == 0:
            flags.append(option_string)
        elif values.startswith("-"):  # a value that looks like a flag must stay attached to its option
            flags.append(f"{option_string}={values}")
        else:
            flags += [option_string, values]
        namespace.ermrun_flags = flags


def add_arguments(p: argparse.ArgumentParser) -> None:
    from launcher.commands.launch_slurm import add_slurm_arguments
    from launcher.ermrun_options import ERMRUN_OPTIONS

    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    hosts = p.add_argument_group("hosts")
    source = hosts.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--hostfile", help="one node per line: NAME [slots=N] [addr=HOST] [port=N] [user=U] [label=value ...]"
    )
    source.add_argument(
        "--discovery-script",
        metavar="CMD",
        help="a command that prints the hosts available now, in the hostfile format",
    )
    hosts.add_argument(
        "--discovery-interval",
        type=float,
        default=10.0,
        help="seconds between runs of the discovery script, or re-reads of the hostfile (default 10)",
    )
    hosts.add_argument(
        "--discovery-timeout",
        type=float,
        default=30.0,
        help="seconds the discovery script may take (default 30)",
    )
    hosts.add_argument(
        "--select",
        action="append",
        default=[],
        metavar="LABEL=VALUE",
        help="only hosts with this label (repeatable; all must match)",
    )
    add_slurm_arguments(p, source)
    ssh = p.add_argument_group("ssh")
    ssh.add_argument("--ssh-user", help="login name on the hosts (default: ssh's; a hostfile user= wins)")
    ssh.add_argument("--ssh-port", type=int, help="ssh port (default: ssh's; a hostfile port wins)")
    ssh.add_argument("--ssh-identity", metavar="KEY", help="private key file (ssh -i)")
    ssh.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra ssh -o option (repeatable)",
    )
    ssh.add_argument("--ssh-binary", default="ssh", help="the OpenSSH client (default: ssh on PATH)")
    ssh.add_argument(
        "--connect-timeout", type=int, default=10, help="seconds for an ssh connection (default 10)"
    )
    remote = p.add_argument_group("on the hosts")
    remote.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME[=VALUE]",
        help="environment variable to set on the hosts; NAME alone forwards this shell's value (repeatable)",
    )
    remote.add_argument(
        "--workdir",
        default=os.getcwd(),
        help="directory ermrun starts in (default: this one; the script path is relative to it)",
    )
    remote.add_argument(
        "--python",
        default=sys.executable,
        help=f"Python with elastic-rm installed on the hosts (default: {sys.executable})",
    )
    ex = p.add_argument_group("executor")
    ex.add_argument(
        "--stop-grace",
        type=float,
        default=30.0,
        help="seconds a stopped node gets before it is killed (default 30)",
    )
    ex.add_argument(
        "--exit-grace",
        type=float,
        default=60.0,
        help="seconds nodes get to exit after the job ended (default 60)",
    )
    ex.add_argument(
        "--host-failures", type=int, default=2, help="failures in a row that blacklist a host (default 2)"
    )
    ex.add_argument(
        "--blacklist-cooldown",
        type=float,
        default=60.0,
        help="seconds a host stays blacklisted; doubled on each repeat (default 60)",
    )
    ex.add_argument(
        "--max-cooldown", type=float, default=600.0, help="longest blacklist cooldown (default 600)"
    )
    ex.add_argument(
        "--poll-interval",
        type=float,
        default=1.0,
        help="seconds between looks at the run in etcd (default 1)",
    )
    ex.add_argument(
        "--idle-timeout",
        type=float,
        default=300.0,
        help="give up after this long with no node running and no host free (default 300)",
    )
    ex.add_argument("--events-file", help="also append the launcher's events to this JSONL file")
    ermrun = p.add_argument_group("ermrun", "every ermrun flag (ermrun --help), passed to each host's ermrun")
    for spellings, takes_value in ERMRUN_OPTIONS:
        long_name = next(s for s in spellings if s.startswith("--"))
        ermrun.add_argument(
            *spellings,
            dest="ermrun_" + long_name[2:].replace("-", "_"),
            action=_ErmrunFlag,
            nargs=None if takes_value else 0,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    p.set_defaults(ermrun_flags=[])
    p.add_argument("training_script", help="the training script (or module with -m), as for ermrun")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)


def _fail(message: str) -> int:
    print(f"erm launch: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    from elastic_rm.launch.discovery import DiscoveryError
    from elastic_rm.launch.hostfile import HostfileError
    from elastic_rm.launch.interrupts import Interrupts
    from elastic_rm.launch.ssh import SshConfigError

    try:
        launch_plan.check_durations(args)
    except ValueError as exc:
        return _fail(str(exc))
    if args.slurm:
        return _run_slurm(args)
    if args.call_in:
        return _fail("--call-in lends Slurm nodes: it works with --slurm only")
    try:
        # Ctrl-C, SIGTERM or SIGHUP while erm launch reads its input (ermrun's parser loads torch, the
        # discovery script runs, etcd is slow to answer): no node was started yet; exit 130 with a line
        # instead of a traceback (the discovery script is killed by run_discovery)
        with Interrupts(how="nothing started yet", first="interrupted before the run started"):
            plan = launch_plan.plan(args)
            client = launch_plan.connect(plan.settings, plan.ns.rdzv_id)
    except KeyboardInterrupt:
        print("erm launch: no node was started", file=sys.stderr)
        return 130
    except SystemExit as exc:  # ermrun's parser printed the usage error
        return int(exc.code or 2)
    except (launch_plan.Refused, ValueError, SshConfigError, HostfileError, DiscoveryError) as exc:
        return _fail(str(exc))
    return _execute(args, plan, client)


BEGIN_HOSTS = 64  # host names in the begin event (at most 128 characters each: 8 KiB)
PARSER_WAIT_S = 10.0  # how long an interrupted erm launch waits for the parser thread, to close its client


class _ParserCheck(threading.Thread):
    """ermrun's parser (torchrun's, which loads torch: seconds on a busy login node) reads the flags, and
    erm launch connects to etcd, in a thread: meanwhile the main thread checks Slurm and submits the run's
    first node jobs."""

    def __init__(self, args: argparse.Namespace):
        super().__init__(name="erm-launch-parser", daemon=True)
        self._args = args
        self.value: tuple | None = None  # (ns, flags, script, settings, nnodes, client)
        self.refusal: str | None = None  # erm launch's error message
        self.exit_code: int | None = None  # the parser refused and printed its usage error

    @property
    def refused(self) -> bool:
        return self.refusal is not None or self.exit_code is not None

    def close_client(self, interrupts) -> None:
        """The etcd client this thread opened, if any, closed; waits for the thread first (bounded, and no
        longer once one more signal asks erm launch to return: interrupts.leave)."""
        deadline = time.monotonic() + PARSER_WAIT_S
        while self.is_alive() and not interrupts.leave and time.monotonic() < deadline:
            self.join(0.2)
        if self.value is not None:
            self.value[-1].close()

    def run(self) -> None:
        from elastic_rm.launch.slurm_cli import SlurmError
        from launcher.commands.launch_slurm import check_poll_interval

        try:
            ns, flags, script = launch_plan.ermrun_command_line(self._args)
            nnodes = launch_plan.nnodes(ns)
            settings = launch_plan.settings_of(ns, *nnodes)
            check_poll_interval(self._args)
            self.value = (ns, flags, script, settings, nnodes, launch_plan.connect(settings, ns.rdzv_id))
        except SystemExit as exc:
            self.exit_code = int(exc.code or 2)
        except (launch_plan.Refused, ValueError, SlurmError) as exc:
            self.refusal = str(exc)
        except Exception as exc:  # reported as erm launch's error, not lost with the thread
            self.refusal = f"{type(exc).__name__}: {exc}"


def _run_slurm(args: argparse.Namespace) -> int:
    """Checks the input and runs the Slurm executor. The run's first node jobs are submitted while
    ermrun's parser loads (_ParserCheck), from erm launch's own reading of the few flags they depend on
    (read_first); if the parser refuses the flags, or reads them otherwise, those jobs are cancelled (and
    gone from squeue) before erm launch exits with the parser's message. Any other way out before the
    executor runs (an error, Ctrl-C, SIGTERM: elastic_rm.launch.interrupts) cancels them too."""
    from elastic_rm.launch.interrupts import Interrupts
    from elastic_rm.launch.slurm_cli import SlurmError
    from launcher.commands.launch_slurm import (
        FirstJobs,
        cancel_first,
        check_local,
        check_slurm,
        execute_slurm,
        job_file_of,
        read_first,
        submit_first,
    )

    try:
        check_local(args)
    except ValueError as exc:
        return _fail(str(exc))
    first = read_first(list(args.ermrun_flags))
    if first is not None:
        args.ermrun_flags = first.flags  # a made-up run id: the same for the parser and the node jobs
    parser = _ParserCheck(args)
    jobs = FirstJobs()
    checked = None
    handed_over = False  # the etcd client: execute_slurm closes it
    with Interrupts() as interrupts:
        try:
            parser.start()
            slurm_error = None
            if first is not None:
                script = [args.training_script, *args.training_script_args]
                try:
                    checked = check_slurm(args, first.run_id, first.flags, script, first.job_file)
                    if not parser.refused:
                        low, high = first.nnodes
                        count = max(low, min(checked[1].requested_nodes or low, high))
                        submit_first(checked, count, jobs)
                except (ValueError, SlurmError) as exc:
                    slurm_error = exc
            parser.join()
            if parser.refused or slurm_error is not None:
                if checked is not None:
                    cancel_first(checked, jobs, args.stop_grace, interrupts)
                if parser.value is not None:
                    parser.value[-1].close()
                if parser.exit_code is not None:
                    return parser.exit_code
                return _fail(parser.refusal or str(slurm_error))
            ns, flags, script, settings, nnodes, client = parser.value
            read = (ns.rdzv_id, nnodes, job_file_of(ns))
            if first is None or read != (first.run_id, first.nnodes, first.job_file):
                if checked is not None:
                    cancel_first(checked, jobs, args.stop_grace, interrupts)
                    if not interrupts.resume():  # a signal came while they stopped
                        return 130
                jobs = FirstJobs()
                try:
                    checked = check_slurm(args, ns.rdzv_id, flags, script, job_file_of(ns))
                except (ValueError, SlurmError) as exc:
                    client.close()
                    return _fail(str(exc))
            handed_over = True
            return execute_slurm(args, ns, settings, checked, nnodes, client, interrupts, jobs.submitted)
        except KeyboardInterrupt:
            left = cancel_first(checked, jobs, args.stop_grace, interrupts) if checked is not None else []
            if not handed_over:
                parser.close_client(interrupts)
            if jobs.before:
                before = " ".join(sorted(jobs.before))
                print(
                    f"erm launch: interrupted before the run started: job(s) {before} of the run were "
                    f"running before this launcher: `erm launch` again adopts them, or scancel {before}",
                    file=sys.stderr,
                )
            elif not left:
                print(
                    "erm launch: interrupted before the run started: no node job it submitted is left "
                    "(Slurm lists none of them any more)",
                    file=sys.stderr,
                )
            return 130
        except Exception as exc:
            interrupts.stop()
            if checked is not None:
                cancel_first(checked, jobs, args.stop_grace, interrupts)
            if parser.value is not None and not handed_over:
                parser.value[-1].close()
            return _fail(
                f"{type(exc).__name__}: {exc} (the run's node jobs erm launch had submitted are cancelled)"
            )


def _stop_command(plan: launch_plan.Plan, run_id: str) -> str:
    """The `erm stop` command line that reaches the run's etcd as erm launch does (its key prefix, TLS
    and user; the password from $ELASTIC_RM_ETCD_PASSWORD, as erm launch read it)."""
    from elastic_rm.wire.keyspace import DEFAULT_PREFIX

    settings = plan.settings
    argv = ["erm", "stop", run_id, "--endpoint", plan.ns.rdzv_endpoint]
    if settings.keys.prefix != DEFAULT_PREFIX:
        argv += ["--prefix", settings.keys.prefix]
    tls = settings.tls
    for flag, value in (
        ("--etcd-cacert", tls.ca_cert),
        ("--etcd-cert", tls.cert),
        ("--etcd-key", tls.key),
        ("--etcd-user", settings.user),
    ):
        if value:
            argv += [flag, value]
    return shlex.join(argv)


def _execute(args: argparse.Namespace, plan: launch_plan.Plan, client) -> int:
    """Run the executor until the job ends (or Ctrl-C, SIGTERM: every node is stopped, a second one kills
    them at once, a third returns: elastic_rm.launch.interrupts); its exit status."""
    from elastic_rm.launch.command import NodeCommand
    from elastic_rm.launch.executor import Executor, ExecutorConfig
    from elastic_rm.launch.interrupts import Interrupts
    from elastic_rm.launch.node import RemoteNode
    from elastic_rm.obs.events import EventLog

    run_id, keys, hosts = plan.ns.rdzv_id, plan.settings.keys, plan.hosts
    lock = threading.Lock()

    def print_line(line: str) -> None:
        with lock, contextlib.suppress(OSError):
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def say(message: str) -> None:
        with lock, contextlib.suppress(OSError):  # a terminal gone (SIGHUP) must not break the stop
            sys.stderr.write(f"[erm launch] {message}\n")
            sys.stderr.flush()

    command = NodeCommand(
        plan.ssh, args.python, args.workdir, tuple(plan.flags), tuple(plan.script), plan.env, args.stop_grace
    )
    events = EventLog(run_id, "erm-launch", path=args.events_file, client=client, keys=keys)
    config = ExecutorConfig(
        plan.min_nodes,
        plan.max_nodes,
        poll_s=args.poll_interval,
        stop_grace_s=args.stop_grace,
        exit_grace_s=args.exit_grace,
        idle_timeout_s=args.idle_timeout,
        discovery_interval_s=args.discovery_interval,
    )
    interrupts = Interrupts(how="each host's ermrun and its workers killed")
    executor = Executor(
        client,
        keys,
        plan.pool,
        lambda host: RemoteNode(host, command.argv(host), print_line),
        events,
        config,
        say,
        discover=plan.discover,
        known_hosts=hosts,
        interrupts=interrupts,
    )
    nodes = f"{plan.min_nodes}-{plan.max_nodes} node(s)"
    with interrupts:
        try:
            say(f"run {run_id}: {len(hosts)} host(s), {nodes}, etcd {plan.ns.rdzv_endpoint}")
            events.emit(
                "launch",
                f"erm launch started run {run_id} with {len(hosts)} host(s)",
                action="begin",
                # the first BEGIN_HOSTS names: an event past 16 KiB is refused with ValueError (600 hosts
                # of 30-character names ended erm launch at its start)
                hosts=[h.name for h in hosts[:BEGIN_HOSTS]],
                host_count=len(hosts),
                min_nodes=plan.min_nodes,
                max_nodes=plan.max_nodes,
            )
            return executor.run()
        except KeyboardInterrupt:
            left = executor.stop_all("erm launch was interrupted")  # what the executor's own stop left
            if not left:
                say("interrupted: every node was stopped")
            else:
                say(
                    f"interrupted: node(s) on {', '.join(left)} may still run (see above); "
                    f"`{_stop_command(plan, run_id)}` ends the run on every host"
                )
            return 130
        finally:
            interrupts.stop()
            events.flush()
            events.close()
            client.close()
