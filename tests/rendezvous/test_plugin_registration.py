"""torch loads the ``elastic-rm`` rendezvous plugin (a ``torchrun.handlers`` entry point) while its
rendezvous package is first imported, whichever of our modules imports it first: the plugin must load
then without a circular import, or torch logs a warning on stderr and the backend is missing."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WARNING = "Exception while registering out of tree plugin"


def run_fresh(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.parametrize(
    "first",
    [
        "elastic_rm.rendezvous.settings",
        # each imports torch in a new process (~4 s): CI keeps two, make test-all runs every one
        pytest.param("elastic_rm.rendezvous.registration", marks=pytest.mark.slow),
        pytest.param("elastic_rm.rendezvous.handler", marks=pytest.mark.slow),
        "launcher.ermrun",
        pytest.param("elastic_rm.agent.entry", marks=pytest.mark.slow),
    ],
)
def test_the_plugin_loads_whichever_module_is_imported_first(first: str) -> None:
    code = (
        f"import {first}\n"
        "from torch.distributed.elastic.rendezvous import rendezvous_handler_registry\n"
        "from elastic_rm.rendezvous.registration import create_handler\n"
        "print(rendezvous_handler_registry._registry['elastic-rm'] is create_handler)\n"
    )
    done = run_fresh(code)
    assert done.returncode == 0, done.stderr
    assert WARNING not in done.stderr, done.stderr
    assert done.stdout.strip() == "True"


def test_erm_launch_slurm_prints_no_plugin_warning() -> None:
    """The path every ``erm launch --slurm`` takes: it reads ermrun's flags before torch is loaded. It
    stops at the unreachable etcd (a closed loopback port), after the plugin has loaded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [
        "erm",
        "launch",
        "--slurm",
        "--nnodes",
        "1:2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "/bin/true",
    ]
    done = run_fresh(f"import sys\nfrom launcher.erm import main\nsys.argv = {argv!r}\nsys.exit(main())\n")
    assert "cannot reach etcd" in done.stderr, done.stderr
    assert WARNING not in done.stderr, done.stderr
