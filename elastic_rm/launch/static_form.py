"""ermrun in torchrun's static multi-node form: ``--nnodes N --node-rank R --master-addr A --master-port P``.

That form is how most multi-node torchrun jobs start on bare metal (a script per host, or one ``srun``
task per node): node rank 0 serves a store at A:P and the others connect to it. ermrun keeps the
command and the meaning: node rank 0 starts the run's etcd (the embedded single-member server) on port
P of every interface, advertised as A, and the other nodes use ``--rdzv-endpoint A:P``, waiting for it
as torchrun's nodes wait for the master's store. The rendezvous is then ermrun's (leases, rounds, the
planner), not torch's static one.

What it shares with torchrun's form: the run lives as long as node rank 0's ermrun does (its etcd goes
with it), and the port is open without authentication on the hosts' network, as torch's store is. A
run that must outlive any one node uses an etcd of its own (``erm etcd``, ``--rdzv-endpoint``).

The form applies only with ermrun's own backend, no ``--rdzv-endpoint`` and ``--nnodes`` above 1, once
any of ``--master-addr``, ``--master-port`` or a non-zero ``--node-rank`` is given (on the command line or
as ``PET_*``); otherwise nothing changes.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..etcd.server import url_host

TORCHRUN_MASTER_ADDR = "127.0.0.1"  # torchrun's defaults: a value other than these was given
TORCHRUN_MASTER_PORT = 29500
POLL_S = 0.5


@dataclass(frozen=True)
class StaticForm:
    """Where this node's run keeps its etcd in the static form."""

    master_addr: str
    master_port: int
    hosts_etcd: bool  # node rank 0: starts it; the others join it

    @property
    def listen_host(self) -> str:
        """Every interface of the master address's family."""
        return "::" if ":" in self.master_addr else "0.0.0.0"

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.master_addr else socket.AF_INET

    @property
    def endpoint(self) -> str:
        return f"{url_host(self.master_addr)}:{self.master_port}"


def master_given(args: argparse.Namespace) -> bool:
    """Whether --master-addr, --master-port or a non-zero --node-rank was given (flag or PET_*)."""
    return args.master_addr != TORCHRUN_MASTER_ADDR or args.master_port is not None or args.node_rank != 0


def static_form(args: argparse.Namespace, backend: str, max_nodes: int) -> StaticForm | None:
    """The static form this ermrun's flags ask for, else None (see the module docstring)."""
    if args.rdzv_backend != backend or args.rdzv_endpoint or max_nodes <= 1 or not master_given(args):
        return None
    if args.node_rank < 0 or args.node_rank >= max_nodes:
        raise ValueError(
            f"--node-rank must be in [0, {max_nodes}) for --nnodes {args.nnodes}, got {args.node_rank}"
        )
    if not args.master_addr:
        raise ValueError("--master-addr is empty: give node rank 0's address, which every node can reach")
    port = TORCHRUN_MASTER_PORT if args.master_port is None else args.master_port
    if not 0 < port < 65536:
        raise ValueError(f"--master-port must be a TCP port (1-65535), got {port}")
    return StaticForm(args.master_addr, port, hosts_etcd=args.node_rank == 0)


def check_port_free(form: StaticForm) -> None:
    """Node rank 0: ValueError, naming the flag, when its etcd could not listen on --master-port (etcd's
    own failure is pages of log)."""
    try:
        with socket.create_server((form.listen_host, form.master_port), family=form.family):
            pass
    except OSError as exc:
        why = os.strerror(exc.errno) if exc.errno else str(exc)
        raise ValueError(
            f"--master-port {form.master_port}: node rank 0 starts the run's etcd there, but this host "
            f"cannot listen on it ({why}): choose another port, the same on every node"
        ) from None


def wait_for_master(
    form: StaticForm, timeout_s: float, on_wait: Callable[[str], None] | None = None
) -> float:
    """Block until node rank 0's etcd port accepts connections (as torchrun's nodes wait for the master's
    store); the seconds waited. ``on_wait(why)`` is called once, at the first refused try. ValueError
    after ``timeout_s``, naming the address and what to check."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last = ""
    while True:
        try:
            with socket.create_connection((form.master_addr, form.master_port), timeout=min(2.0, timeout_s)):
                return time.monotonic() - t0
        except OSError as exc:
            if not last and on_wait is not None:
                on_wait(str(exc) or type(exc).__name__)
            last = str(exc) or type(exc).__name__
        if time.monotonic() + POLL_S > deadline:
            raise ValueError(
                f"node rank 0's etcd at {form.endpoint} did not answer in {timeout_s:.0f}s ({last}): start "
                "ermrun with --node-rank 0 on the host --master-addr names, check that every node can reach "
                f"port {form.master_port} there, or raise --rdzv-conf join_timeout"
            )
        time.sleep(POLL_S)
