"""ermrun as a user runs it: the embedded etcd, torchrun's flags, and clear errors for bad input."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import tempfile
import uuid

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.wire.records import ClosedRecord
from tests.conftest import BIN
from tests.e2e.helpers import STEPS, ermrun, ermrun_here, records, steps_at_world, wait_until
from tests.leftovers import ENV_SESSION, marked_processes

ERMRUN = os.path.join(BIN, "ermrun")


def run(args: list[str], tmp_path, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "STEPS_DIR": str(tmp_path), "STEPS_NODE": "e", "STEPS_MAX": "3", **env}
    return subprocess.run([ERMRUN, *args], env=full_env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def steps_env(tmp_path, monkeypatch):
    """The environment run() gives a real ermrun: a worker that started would log under tmp_path."""
    for name, value in {"STEPS_DIR": str(tmp_path), "STEPS_NODE": "e", "STEPS_MAX": "3"}.items():
        monkeypatch.setenv(name, value)


def etcd_children() -> set[int]:
    """Every etcd process this test session started: a leaked one is reparented, so children() would
    miss it; other sessions' etcds on the machine do not count."""
    return {p.pid for p in marked_processes(os.environ[ENV_SESSION]) if p.name() == "etcd"}


# --standalone: 7 s; CI keeps the embedded etcd without it, and --standalone's run id below
@pytest.mark.parametrize("extra", [[], pytest.param(["--standalone"], marks=pytest.mark.slow)])
def test_embedded_etcd_runs_a_job_and_is_stopped(tmp_path, extra):
    before = etcd_children()
    result = run([*extra, "--nproc-per-node", "2", STEPS], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert {r["world"] for r in records(tmp_path, "e") if r.get("start")} == {2}
    assert etcd_children() <= before  # the embedded etcd was stopped


def test_standalone_honours_the_run_id(tmp_path):
    """A re-run of the same --standalone job with the same --rdzv-id is the same run (its node memory)."""
    result = run(["--standalone", "--rdzv-id", "my-job", "--nproc-per-node", "1", STEPS], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    starts = [r for r in records(tmp_path, "e") if r.get("start")]
    assert starts and {r["env"]["TORCHELASTIC_RUN_ID"] for r in starts} == {"my-job"}


def test_worker_failure_exits_non_zero_like_torchrun(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("import sys; sys.exit(3)\n")
    result = run(["--nproc-per-node", "1", str(script)], tmp_path)
    assert result.returncode != 0 and "fail.py" in result.stderr


def test_unreachable_endpoint_fails_before_any_worker_and_names_it(tmp_path, capfd, steps_env):
    # in this process (ermrun_here): no torch import of its own
    assert ermrun_here(["--rdzv-endpoint", "127.0.0.1:9", "--rdzv-conf", "etcd_timeout=1", STEPS]) == 2
    err = capfd.readouterr().err
    assert "ermrun: error: " in err and "127.0.0.1:9" in err, err[-2000:]
    assert "Traceback" not in err
    assert records(tmp_path, "e") == []  # it stopped at the rendezvous: no worker started


# In this process (ermrun_here): a process each would spend ~4 s importing torch. The real process's
# refusal, with its exit code, is test_unknown_flag_is_rejected_by_the_parser below.
@pytest.mark.parametrize(
    "args,message",
    [
        (["--nnodes", "3:2"], "min_nodes must be > 0 and <= max_nodes"),
        (["--rdzv-id", "a/b"], "invalid run id"),
        (["--etcd-cert", "/nonexistent/c.pem", "--etcd-key", "/nonexistent/k.pem"], "does not exist"),
        (["--etcd-cert", "/etc/hostname"], "both a client certificate and its key"),
        (["--membership-grace", "-1"], "--membership-grace"),
        (["--job", "/nonexistent/job.json"], "cannot be read"),
        (["--standalone", "--rdzv-endpoint", "127.0.0.1:9"], "--standalone starts its own etcd"),
        (["--rdzv-conf", "lease_tll=3"], "unknown key 'lease_tll'; did you mean 'lease_ttl'?"),
        (["--rdzv-conf", "lease_ttl=3;last_call_timeout=1"], "separates key=value pairs with commas"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path, capfd, steps_env, args, message):
    before = etcd_children()
    assert ermrun_here(["--spares", "off", *args, STEPS]) == 2
    err = capfd.readouterr().err
    assert "ermrun: error: " in err and message in err, err[-2000:]
    assert "Traceback" not in err
    assert etcd_children() <= before
    assert records(tmp_path, "e") == []  # no worker started


@pytest.mark.skipif(
    importlib.util.find_spec("etcd") is not None and importlib.util.find_spec("urllib3") is not None,
    reason="torch's etcd v2 client is installed here (make bench installs it)",
)
def test_the_etcd_v2_backend_without_its_client_says_what_to_install(tmp_path, capfd, steps_env):
    args = ["--spares", "off", "--rdzv-backend", "etcd-v2", "--rdzv-endpoint", "127.0.0.1:9", STEPS]
    assert ermrun_here(args) == 2
    err = capfd.readouterr().err
    assert "pip install python-etcd" in err and "Traceback" not in err, err
    assert records(tmp_path, "e") == []


def test_unknown_flag_is_rejected_by_the_parser(tmp_path):
    result = run(["--no-such-flag", STEPS], tmp_path, timeout=60)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


def test_malformed_round_value_is_reported_with_its_key(etcd, run_id, tmp_path, capfd, steps_env):
    with EtcdClient(etcd.endpoint) as c:
        c.put(f"/elastic-rm/{run_id}/round", b'{"v": 1, "round": "seven"}')
    assert ermrun_here(["--spares", "off", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, STEPS]) == 2
    err = capfd.readouterr().err
    assert f"/elastic-rm/{run_id}/round" in err and "Traceback" not in err, err[-2000:]
    assert records(tmp_path, "e") == []


def test_standalone_help_says_what_ermrun_does():
    from launcher.ermrun import build_parser

    (standalone,) = [a for a in build_parser()._actions if a.dest == "standalone"]
    assert "embedded etcd" in standalone.help and "C10d" not in standalone.help, standalone.help
    assert "ignored" not in standalone.help  # ermrun refuses an --rdzv-endpoint with it


def _closed(etcd, run_id):
    with EtcdClient(etcd.endpoint, timeout=5) as c:
        kv = c.get(f"/elastic-rm/{run_id}/closed")
    return None if kv is None else ClosedRecord.parse("closed", kv.value)


@pytest.mark.slow  # 10 s; CI keeps tests/rendezvous/test_handler.py's refusal of a live node id
def test_a_second_ermrun_under_a_live_nodes_id_is_refused_and_leaves_the_run_open(
    etcd, run_id, tmp_path, procs
):
    args = ["--nnodes", "1:2", "--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--node-id", "x"]
    first = ermrun(tmp_path, "first", args)  # trains until its stop file
    procs.append(first)
    wait_until(lambda: steps_at_world(tmp_path, "first", 1) > 3, 120, "the first node training", [first])
    second = run(["--spares", "off", *args, STEPS], tmp_path, timeout=120)
    assert second.returncode == 2, second.stderr[-2000:]
    assert (
        f"node id 'x' is in use in run {run_id}: pid " in second.stderr and "Traceback" not in second.stderr
    )
    assert _closed(etcd, run_id) is None  # the refused process did not close the run
    before = steps_at_world(tmp_path, "first", 1)
    wait_until(lambda: steps_at_world(tmp_path, "first", 1) > before + 3, 60, "training going on", [first])
    assert first.popen.poll() is None


def test_a_job_started_again_under_the_id_of_a_run_that_failed_says_so_and_fails(
    etcd, run_id, tmp_path, capfd, steps_env
):
    failing = tmp_path / "fail.py"
    failing.write_text("import sys; sys.exit(3)\n")
    args = ["--spares", "off", "--nnodes", "1", "--max-restarts", "0", "--rdzv-endpoint", etcd.endpoint]
    first = run([*args, "--rdzv-id", run_id, str(failing)], tmp_path)
    assert first.returncode != 0
    assert _closed(etcd, run_id).outcome == "failed"
    capfd.readouterr()
    assert ermrun_here([*args, "--rdzv-id", run_id, STEPS]) == 2  # in this process: no second torch import
    err = capfd.readouterr().err
    assert f"run {run_id} ended (failed, closed by " in err and "new --rdzv-id" in err, err[-2000:]
    assert "Traceback" not in err
    assert records(tmp_path, "e") == []  # nothing ran


def test_a_log_dir_the_user_named_is_kept_even_if_it_looks_like_torchs_own(tmp_path):
    """ermrun removes torch's temporary log directory (/tmp/torchelastic_<random>) at exit; a --log-dir
    of that look was taken for it and removed with everything in it."""
    logs = os.path.join(tempfile.gettempdir(), f"torchelastic_{uuid.uuid4().hex[:8]}")
    os.makedirs(logs)
    try:
        with open(os.path.join(logs, "important.txt"), "w") as f:
            f.write("keep")
        result = run(["--log-dir", logs, "--redirects", "3", "--nproc-per-node", "1", STEPS], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert open(os.path.join(logs, "important.txt")).read() == "keep"
        assert [d for d in os.listdir(logs) if d != "important.txt"]  # the run's own logs went there
    finally:
        shutil.rmtree(logs, ignore_errors=True)
