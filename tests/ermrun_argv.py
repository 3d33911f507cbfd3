"""ermrun's (and torchrun's) command line as the tests write it: keyword arguments for flags, so that a
node's command reads as one call instead of a column of strings, and the rendezvous flags of one node in
one place."""

from __future__ import annotations

import os

from tests.conftest import BIN

ERMRUN = os.path.join(BIN, "ermrun")
TORCHRUN = os.path.join(BIN, "torchrun")
CONF = "lease_ttl=2,last_call_timeout=0.5,join_timeout=60"  # short leases: a lost node is seen in seconds


def flags(**values: object) -> list[str]:
    """``node_id="a", spares="off"`` is ``--node-id a --spares off``; a value of True, the flag alone."""
    out: list[str] = []
    for name, value in values.items():
        out.append("--" + name.replace("_", "-"))
        if value is not True:
            out.append(str(value))
    return out


def node_args(
    endpoint: str, run_id: str, nnodes: str, node: str, conf: str = CONF, nproc: int = 1
) -> list[str]:
    """The rendezvous flags of one node of a run."""
    return flags(
        nnodes=nnodes,
        nproc_per_node=nproc,
        rdzv_endpoint=endpoint,
        rdzv_id=run_id,
        rdzv_conf=conf,
        node_id=node,
    )


def ermrun_argv(*args: str, **values: object) -> list[str]:
    """``ermrun``, the keyword flags, then ``args``: more flags (:func:`node_args`), the script and its own
    arguments."""
    return [ERMRUN, *flags(**values), *args]
