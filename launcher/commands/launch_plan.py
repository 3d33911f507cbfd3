"""What `erm launch` was asked, checked before it starts anything: the ermrun command line every node gets,
the run's rendezvous settings, how to reach the etcd, the hosts (ssh, hostfile or discovery script) and the
executor's seconds. A reason not to start is a ``Refused`` (or ValueError) that erm launch prints."""

from __future__ import annotations

import argparse
import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class Refused(Exception):
    """A reason not to start anything, printed as erm launch's error."""


def _labels(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (i.strip() for i in (text or "").split(","))):
        key, _, value = item.partition("=")
        out[key.strip()] = value.strip()
    return out


def ermrun_command_line(args: argparse.Namespace) -> tuple[argparse.Namespace, list[str], list[str]]:
    """The ermrun flags and script every host gets, parsed as ermrun would and checked for what cannot
    work across hosts; a run id is made up when none is given. SystemExit on a parse error."""
    from elastic_rm.rendezvous.backend import BACKEND
    from launcher.ermrun import build_parser

    flags = list(args.ermrun_flags)
    script = [args.training_script, *args.training_script_args]
    ns = build_parser().parse_args([*flags, *script])
    if ns.rdzv_backend != BACKEND:
        raise Refused(f"erm launch runs the {BACKEND} rendezvous; remove --rdzv-backend {ns.rdzv_backend}")
    if ns.standalone or not ns.rdzv_endpoint:
        raise Refused(
            "erm launch needs --rdzv-endpoint HOST:PORT of an etcd that every host reaches (start one with "
            '`erm etcd`, README "A real cluster"); --standalone\'s loopback etcd cannot serve other hosts'
        )
    if ns.node_id:
        raise Refused("erm launch names each node after its hostfile entry; remove --node-id")
    if ns.rdzv_id in ("", "none"):
        ns.rdzv_id = f"job-{uuid.uuid4().hex[:8]}"
        flags.append(f"--rdzv-id={ns.rdzv_id}")
    return ns, flags, script


def nnodes(ns: argparse.Namespace) -> tuple[int, int]:
    from torch.distributed.run import parse_min_max_nnodes

    min_nodes, max_nodes = parse_min_max_nnodes(ns.nnodes)
    if not 1 <= min_nodes <= max_nodes:
        raise Refused(f"--nnodes {ns.nnodes} is invalid: need 1 <= MIN <= MAX (e.g. --nnodes 2:4)")
    return min_nodes, max_nodes


def settings_of(ns: argparse.Namespace, min_nodes: int, max_nodes: int):
    """The run's rendezvous settings as every node will read them (`RendezvousSettings`): the etcd
    endpoints, key prefix, TLS, user, password and timeout this launcher uses too. The job description
    is left to the nodes: its path is theirs (relative to --workdir on the hosts)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    from elastic_rm.rendezvous.backend import BACKEND
    from elastic_rm.rendezvous.settings import RendezvousSettings
    from launcher.ermrun import add_settings_flags

    add_settings_flags(ns)
    conf = _parse_rendezvous_config(ns.rdzv_conf)
    for key in ("job_file", "policy"):
        conf.pop(key, None)
    params = RendezvousParameters(BACKEND, ns.rdzv_endpoint, ns.rdzv_id, min_nodes, max_nodes, **conf)
    return RendezvousSettings.from_parameters(params)


def ssh_options(args: argparse.Namespace):
    from elastic_rm.launch.ssh import SshOptions

    ssh = SshOptions(
        args.ssh_binary,
        args.ssh_user,
        args.ssh_port,
        args.ssh_identity,
        tuple(args.ssh_option),
        args.connect_timeout,
    )
    ssh.validate()
    return ssh


def host_source(args: argparse.Namespace):
    """A function that reads the hosts available now, with the --select labels: the discovery script's
    answer, or the hostfile (edit it to add or drain hosts)."""
    from elastic_rm.launch.discovery import run_discovery
    from elastic_rm.launch.hostfile import read_hostfile

    selected = _labels(",".join(args.select))

    def discover():
        if args.hostfile:
            found = read_hostfile(args.hostfile)
        else:
            found = run_discovery(args.discovery_script, args.discovery_timeout)
        return [h for h in found if all(h.labels.get(k) == v for k, v in selected.items())]

    return discover


def connect(settings, run_id: str):
    """The etcd client of this launcher, once etcd answered and the run is not closed."""
    from elastic_rm.etcd.errors import EtcdError

    client = settings.etcd_client()
    try:
        client.ping()
        closed = client.get(settings.keys.closed) is not None
    except EtcdError as exc:
        client.close()
        raise Refused(f"cannot reach etcd: {exc}") from None
    if closed:
        client.close()
        raise Refused(f"run {run_id} is closed already (it ran before); pass a new --rdzv-id")
    return client


@dataclass
class Plan:
    """What erm launch checked before it starts anything: the nodes' command line, the rendezvous
    settings, how to reach and choose the hosts."""

    ns: argparse.Namespace  # ermrun's parsed flags
    flags: list[str]  # ermrun's flags as typed, for every host
    script: list[str]
    min_nodes: int
    max_nodes: int
    settings: Any  # RendezvousSettings
    ssh: Any  # SshOptions
    env: dict[str, str]
    pool: Any  # HostPool
    discover: Callable[[], list]
    hosts: list


def plan(args: argparse.Namespace) -> Plan:
    """Every check of the ssh path's input but etcd's (connect), the hosts read once."""
    from elastic_rm.launch.command import parse_env
    from elastic_rm.launch.pool import HostPool
    from launcher.commands.launch_slurm import check_local

    # the events file as with --slurm: one that cannot be opened was a traceback once etcd answered
    check_local(args)
    ns, flags, script = ermrun_command_line(args)
    min_nodes, max_nodes = nnodes(ns)
    settings = settings_of(ns, min_nodes, max_nodes)
    ssh = ssh_options(args)
    env = parse_env(args.env)
    pool = HostPool(args.host_failures, args.blacklist_cooldown, args.max_cooldown)
    discover = host_source(args)
    hosts = discover()
    if args.hostfile and not hosts:
        raise Refused(f"no host in {args.hostfile} has the labels {args.select}")
    for h in hosts:
        pool.add(h)
    return Plan(ns, flags, script, min_nodes, max_nodes, settings, ssh, env, pool, discover, hosts)


def check_durations(args: argparse.Namespace) -> None:
    """The executor's seconds, before anything starts: a negative --poll-interval used to start the
    nodes and then end erm launch with a traceback (time.sleep refuses it). ValueError saying which."""
    positive = ("poll_interval", "discovery_interval", "discovery_timeout")
    for name in (*positive, "stop_grace", "exit_grace", "idle_timeout", "pending_report"):
        value = getattr(args, name)
        ok = value > 0 if name in positive else value >= 0  # False for NaN too
        if not ok or (name in ("poll_interval", "discovery_timeout") and not math.isfinite(value)):
            flag = "--" + name.replace("_", "-")
            bound = "> 0" if name in positive else ">= 0"
            raise ValueError(f"{flag} {value:g}: must be a number of seconds {bound}")
