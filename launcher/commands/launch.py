"""`erm launch`: run a job's nodes on bare-metal hosts over ssh; the logic is elastic_rm.launch."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import uuid

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
    from launcher.ermrun import build_parser

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
    for action in build_parser()._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        ermrun.add_argument(
            *action.option_strings,
            dest=f"ermrun_{action.dest}",
            action=_ErmrunFlag,
            nargs=0 if action.nargs == 0 else None,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )
    p.set_defaults(ermrun_flags=[])
    p.add_argument("training_script", help="the training script (or module with -m), as for ermrun")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)


def _fail(message: str) -> int:
    print(f"erm launch: error: {message}", file=sys.stderr)
    return 2


def _conf(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (i.strip() for i in (text or "").split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def run(args: argparse.Namespace) -> int:
    from torch.distributed.run import parse_min_max_nnodes

    from elastic_rm.etcd.client import EtcdClient
    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.etcd.options import TlsOptions
    from elastic_rm.launch.command import NodeCommand, parse_env
    from elastic_rm.launch.discovery import DiscoveryError, run_discovery
    from elastic_rm.launch.executor import Executor, ExecutorConfig
    from elastic_rm.launch.hostfile import HostfileError, read_hostfile
    from elastic_rm.launch.node import RemoteNode
    from elastic_rm.launch.pool import HostPool
    from elastic_rm.launch.ssh import SshConfigError, SshOptions
    from elastic_rm.obs.events import EventLog
    from elastic_rm.rendezvous.settings import BACKEND
    from elastic_rm.wire.keyspace import DEFAULT_PREFIX, Keyspace
    from launcher.ermrun import build_parser

    flags = list(args.ermrun_flags)
    script = [args.training_script, *args.training_script_args]
    try:
        ns = build_parser().parse_args([*flags, *script])
    except SystemExit as exc:
        return int(exc.code or 2)
    if ns.rdzv_backend != BACKEND:
        return _fail(f"erm launch runs the {BACKEND} rendezvous; remove --rdzv-backend {ns.rdzv_backend}")
    if ns.standalone or not ns.rdzv_endpoint:
        return _fail(
            "erm launch needs --rdzv-endpoint HOST:PORT of an etcd that every host reaches (start one with "
            '`erm etcd`, README "A real cluster"); --standalone\'s loopback etcd cannot serve other hosts'
        )
    if ns.node_id:
        return _fail("erm launch names each node after its hostfile entry; remove --node-id")
    if ns.rdzv_id in ("", "none"):
        ns.rdzv_id = f"job-{uuid.uuid4().hex[:8]}"
        flags.append(f"--rdzv-id={ns.rdzv_id}")
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(ns.nnodes)
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"--nnodes {ns.nnodes} is invalid: need 1 <= MIN <= MAX (e.g. --nnodes 2:4)")
        conf = _conf(ns.rdzv_conf)
        keys = Keyspace(conf.get("prefix") or DEFAULT_PREFIX, ns.rdzv_id)
        ssh = SshOptions(args.ssh_binary, args.ssh_user, args.ssh_port, args.ssh_identity,
                         tuple(args.ssh_option), args.connect_timeout)  # fmt: skip
        ssh.validate()
        env = parse_env(args.env)
        pool = HostPool(args.host_failures, args.blacklist_cooldown, args.max_cooldown)
        selected = dict(_conf(",".join(args.select)))
        if args.hostfile:
            hosts = read_hostfile(args.hostfile)
        else:
            hosts = run_discovery(args.discovery_script, args.discovery_timeout)
    except (ValueError, SshConfigError, HostfileError, DiscoveryError) as exc:
        return _fail(str(exc))

    def chosen(found):
        return [h for h in found if all(h.labels.get(k) == v for k, v in selected.items())]

    hosts = chosen(hosts)
    if args.hostfile and not hosts:
        return _fail(f"no host in {args.hostfile} has the labels {args.select}")
    for h in hosts:
        pool.add(h)
    tls = TlsOptions(ns.etcd_cacert or conf.get("ca_cert"), ns.etcd_cert or conf.get("ssl_cert"),
                     ns.etcd_key or conf.get("ssl_cert_key"))  # fmt: skip
    user = ns.etcd_user or conf.get("user")
    password = (conf.get("password") or os.environ.get("ELASTIC_RM_ETCD_PASSWORD")) if user else None
    try:
        client = EtcdClient(ns.rdzv_endpoint, timeout=float(conf.get("etcd_timeout", 5)), tls=tls,
                            user=user, password=password)  # fmt: skip
        client.ping()
        if client.get(keys.closed) is not None:
            client.close()
            return _fail(f"run {ns.rdzv_id} is closed already (it ran before); pass a new --rdzv-id")
    except EtcdError as exc:
        return _fail(f"cannot reach etcd: {exc}")

    lock = threading.Lock()

    def print_line(line: str) -> None:
        with lock:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()

    def say(message: str) -> None:
        with lock:
            sys.stderr.write(f"[erm launch] {message}\n")
            sys.stderr.flush()

    command = NodeCommand(ssh, args.python, args.workdir, tuple(flags), tuple(script), env, args.stop_grace)
    events = EventLog(ns.rdzv_id, "erm-launch", path=args.events_file, client=client, keys=keys)

    def discover():
        """Re-read the hosts: the discovery script's answer, or the hostfile (edit it to add or drain hosts)."""
        if args.hostfile:
            return chosen(read_hostfile(args.hostfile))
        return chosen(run_discovery(args.discovery_script, args.discovery_timeout))

    config = ExecutorConfig(
        min_nodes, max_nodes, poll_s=args.poll_interval, stop_grace_s=args.stop_grace,
        exit_grace_s=args.exit_grace, idle_timeout_s=args.idle_timeout,
        discovery_interval_s=args.discovery_interval,
    )  # fmt: skip
    executor = Executor(
        client, keys, pool, lambda host: RemoteNode(host, command.argv(host), print_line), events, config,
        say, discover=discover, known_hosts=hosts,
    )  # fmt: skip
    say(f"run {ns.rdzv_id}: {len(hosts)} host(s), {min_nodes}-{max_nodes} node(s), etcd {ns.rdzv_endpoint}")
    events.emit("launch", f"erm launch started run {ns.rdzv_id} with {len(hosts)} host(s)", action="begin",
                hosts=[h.name for h in hosts], min_nodes=min_nodes, max_nodes=max_nodes)  # fmt: skip

    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return executor.run()
    except KeyboardInterrupt:
        say("interrupted: every node was stopped")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        events.flush()
        events.close()
        client.close()
