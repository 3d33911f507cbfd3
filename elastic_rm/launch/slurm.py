"""ermrun inside a Slurm allocation: the node count, run id, node id and etcd address from Slurm.

Inside ``srun`` (one task per node), every ermrun of the step agrees without flags:

- ``--nnodes``: the step's node count (``SLURM_STEP_NUM_NODES``, else ``SLURM_JOB_NUM_NODES`` or
  ``SLURM_NNODES``);
- ``--rdzv-id``: ``slurm-<job id>-<step id>``;
- ``--node-id``: the Slurm node name (``SLURMD_NODENAME``; ``-<local id>`` added for a second task on a node);
- ``--rdzv-endpoint``: ``<first node of the step>:2379``, where the sbatch script runs ``erm etcd`` (the
  batch script runs on the first node of the allocation; docs/launch.md has the sbatch example), unless
  torchrun's static form names the etcd's place (``--master-addr``, :mod:`.static_form`).

Flags given on the command line (or through PET_* variables) always win. ``ERM_SLURM=0`` turns this off.
Node lists are expanded by ``scontrol show hostnames`` when it exists, else by :func:`expand_hostlist`.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import re
import shutil
import subprocess
from collections.abc import Mapping

log = logging.getLogger(__name__)

ETCD_PORT = 2379


class SlurmError(ValueError):
    """A Slurm variable that cannot be read (names it)."""


def in_srun(env: Mapping[str, str]) -> bool:
    """A task of a Slurm job step (srun), not the batch script itself."""
    return env.get("ERM_SLURM", "1") != "0" and "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets: ``a[1-2],b`` -> ``a[1-2]``, ``b``."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise SlurmError(f"unbalanced brackets in Slurm node list {text!r}")
    parts.append(cur)
    return [p for p in parts if p]


def _expand_range(body: str, text: str) -> list[str]:
    out = []
    for item in body.split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmError(f"bad range {item!r} in Slurm node list {text!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise SlurmError(f"range {item!r} runs backwards in Slurm node list {text!r}")
        width = len(lo) if lo.startswith("0") else 0  # node[01-10]: keep the zero padding
        out += [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    return out


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list: ``node[01-03],gpu7,rack[1-2]-n[1-2]`` -> every host name, in order."""
    hosts: list[str] = []
    for part in _split_top(text.strip()):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_expand_range(p[1:-1], text) if p.startswith("[") else [p] for p in pieces if p != ""]
        hosts += ["".join(c) for c in itertools.product(*choices)]
    if not hosts:
        raise SlurmError(f"empty Slurm node list {text!r}")
    return hosts


def node_list(env: Mapping[str, str]) -> list[str]:
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if env.get(name):
            text = env[name]
            break
    else:
        raise SlurmError("no SLURM_STEP_NODELIST / SLURM_JOB_NODELIST in the environment")
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol:
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", text], capture_output=True, text=True, timeout=10, check=True
            ).stdout.split()
            if out:
                return out
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("scontrol show hostnames failed (%s); expanding %r ourselves", exc, text)
    return expand_hostlist(text)


def node_count(env: Mapping[str, str]) -> int:
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        value = env.get(name)
        if value:
            if not value.isdigit() or int(value) < 1:
                raise SlurmError(f"{name}={value!r} is not a node count")
            return int(value)
    return len(node_list(env))


def node_id(env: Mapping[str, str]) -> str:
    name = env.get("SLURMD_NODENAME") or env.get("HOSTNAME") or "node"
    local = env.get("SLURM_LOCALID", "0")
    return name if local in ("", "0") else f"{name}-{local}"


def apply_slurm(
    args: argparse.Namespace, parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None
) -> list[str]:
    """Fill ermrun's flags that were left at their defaults from Slurm; returns what was taken, for the log.
    Nothing changes outside srun, with ERM_SLURM=0, with --standalone or with another rendezvous backend."""
    env = os.environ if env is None else env
    if not in_srun(env) or getattr(args, "standalone", False):
        return []
    from ..rendezvous.backend import BACKEND
    from .static_form import master_given

    if args.rdzv_backend != BACKEND:
        return []
    taken = []

    def default(dest: str) -> bool:
        return getattr(args, dest) == parser.get_default(dest)

    if default("nnodes"):
        args.nnodes = str(node_count(env))
        taken.append(f"--nnodes {args.nnodes}")
    if default("rdzv_id"):
        args.rdzv_id = f"slurm-{env['SLURM_JOB_ID']}-{env['SLURM_STEP_ID']}"
        taken.append(f"--rdzv-id {args.rdzv_id}")
    if default("node_id"):
        args.node_id = node_id(env)
        taken.append(f"--node-id {args.node_id}")
    # torchrun's static form (--master-addr...) names its own etcd: node rank 0 starts it (static_form)
    if default("rdzv_endpoint") and args.nnodes not in ("1", "1:1") and not master_given(args):
        args.rdzv_endpoint = f"{node_list(env)[0]}:{ETCD_PORT}"
        taken.append(f"--rdzv-endpoint {args.rdzv_endpoint}")
    return taken
