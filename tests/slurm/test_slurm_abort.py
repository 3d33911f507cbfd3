"""Ctrl-C, SIGTERM and SIGHUP while `erm launch --slurm` starts or stops the run: whenever they land (while
sbatch runs, between the first node jobs' submission and the executor, twice during the stop), no job of
the run is left in squeue, erm launch exits 130 and says what it cancels, never with a traceback."""

from __future__ import annotations

import os
import re
import signal
import sys

import pytest

from tests.e2e.helpers import wait_until
from tests.slurm.cluster import find
from tests.slurm.helpers import launch, run_jobs, tool_env

AGAIN = "interrupted again: stopping the run's nodes now (scancel)"


def holder(tmp_path, ignore_term: bool) -> str:
    """The node jobs' "python": it only holds the node. ``ignore_term``: like an ermrun that does not leave,
    so that the graceful stop lasts its whole --stop-grace unless a second signal cuts it short."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + ("trap '' TERM\n" if ignore_term else "") + "exec sleep 300\n")
    path.chmod(0o755)
    return str(path)


def held_sbatch(tmp_path, cluster, call: int) -> dict[str, str]:
    """The environment of an erm launch whose ``call``-th submission (not counting --test-only) hangs after
    Slurm took its job and the job runs: its id never comes back, as when sbatch is interrupted. The id
    goes to the file ``took``, then the file ``held`` says it hangs."""
    body = f"""case " $* " in *" --test-only "*) exec {find("sbatch")} "$@";; esac
echo >> {tmp_path}/calls
[ "$(wc -l < {tmp_path}/calls)" -eq {call} ] || exec {find("sbatch")} "$@"
out=$({find("sbatch")} "$@") || exit $?
echo "${{out%%;*}}" > {tmp_path}/took
i=0
while [ $i -lt 300 ] && [ "$(squeue -h -j "${{out%%;*}}" -o %T)" != RUNNING ]; do sleep 0.1; i=$((i+1)); done
touch {tmp_path}/held
exec sleep 300
"""
    return tool_env(tmp_path, "sbatch", body, cluster.env())


def interrupt(p, how: str) -> None:
    """SIGTERM to erm launch alone, or a terminal's Ctrl-C: SIGINT to its whole process group (its sbatch,
    squeue or scancel of the moment included)."""
    if how == "sigterm":
        os.kill(p.pid, signal.SIGTERM)
    else:
        os.killpg(p.pid, signal.SIGINT)  # Proc starts erm launch in a session (and group) of its own


@pytest.mark.parametrize(
    "nnodes, call, how",
    [
        pytest.param("1", 1, "sigterm", id="the-first-node-job-before-the-executor"),
        # the same path as SIGTERM's, with the process group's sbatch interrupted too: make test-all
        pytest.param("1", 1, "ctrl-c", id="the-first-node-job-ctrl-c", marks=pytest.mark.slow),
        pytest.param("1:2", 2, "sigterm", id="a-growth-node-job-of-the-executor", marks=pytest.mark.slow),
    ],
)
def test_an_interrupted_sbatchs_job_is_stopped_and_a_second_signal_cancels_at_once(
    etcd, run_id, tmp_path, procs, slurm, nnodes, call, how
):
    extra = ["--python", holder(tmp_path, ignore_term=True), "--stop-grace", "300"]
    env = held_sbatch(tmp_path, slurm, call)
    p = launch(tmp_path, slurm, etcd, run_id, nnodes, extra=extra, env=env)
    procs.append(p)
    wait_until(lambda: (tmp_path / "held").exists(), 60, "sbatch hanging after Slurm took its job", [p])
    took = (tmp_path / "took").read_text().strip()
    interrupt(p, how)
    # the stop names the job whose id sbatch never returned, and sends its ermrun SIGTERM (ignored here)
    wait_until(lambda: re.search(rf"stopping .*\b{took}\b", p.output()), 60, f"the stop of job {took}", [p])
    interrupt(p, how)  # the graceful stop would wait --stop-grace (300 s): cut short
    assert p.wait(60) == 130, p.output()[-3000:]
    out = p.output()
    assert AGAIN in out and "Traceback" not in out, out[-3000:]
    assert "Slurm lists none of them any more" in out, out[-3000:]
    assert run_jobs(slurm, run_id) == []
    assert took in slurm.ended_jobs()


def test_a_sigterm_after_the_first_node_jobs_went_in_while_the_parser_loads_cancels_them(
    etcd, run_id, tmp_path, procs, slurm
):
    """The run's first node jobs are submitted while ermrun's parser loads torch (seconds); a SIGTERM as
    soon as squeue lists them lands before the executor took them over, or as it does."""
    p = launch(tmp_path, slurm, etcd, run_id, "2", extra=["--python", holder(tmp_path, ignore_term=False)])
    procs.append(p)
    wait_until(lambda: len(run_jobs(slurm, run_id)) == 2, 60, "the first node jobs in squeue", [p])
    first = sorted(j["id"] for j in run_jobs(slurm, run_id))
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(60) == 130, p.output()[-3000:]
    out = p.output()
    assert "Traceback" not in out and "interrupted" in out, out[-3000:]
    assert run_jobs(slurm, run_id) == []
    assert set(first) <= set(slurm.ended_jobs()), out[-3000:]


@pytest.mark.slow  # a third signal's edge case (8 s); CI keeps the interrupted sbatch's job at both stages
def test_a_job_scancel_cannot_end_is_named_with_the_scancel_command_on_a_third_signal(
    etcd, run_id, tmp_path, procs, slurm
):
    """scancel refused (here: a scancel that always fails, as for a job of another account): a third signal
    returns without waiting out the bound, naming the job and the command that cancels it."""
    denied = "echo 'scancel: error: Access/permission denied' >&2\nexit 1\n"
    env = tool_env(tmp_path, "scancel", denied, slurm.env())
    extra = ["--python", holder(tmp_path, ignore_term=True), "--stop-grace", "300"]
    p = launch(tmp_path, slurm, etcd, run_id, "1", extra=extra, env=env)
    procs.append(p)
    wait_until(lambda: " runs on " in p.output(), 60, "the node job running", [p])
    (job,) = [j["id"] for j in run_jobs(slurm, run_id)]
    os.kill(p.pid, signal.SIGTERM)
    wait_until(lambda: "stopping node" in p.output(), 60, "the stop", [p])
    os.kill(p.pid, signal.SIGTERM)
    # the hurried scancel failing (the graceful pass's scancel --signal failed before it)
    wait_until(lambda: "[erm launch] scancel failed:" in p.output(), 60, "scancel failing", [p])
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(60) == 130, p.output()[-3000:]
    out = p.output()
    assert "interrupted a third time" in out, out[-3000:]
    assert "Traceback" not in out and f"Slurm may still run job(s) {job}: scancel {job}" in out, out[-3000:]
    assert [j["id"] for j in run_jobs(slurm, run_id)] == [job]  # left, as said (the fixture cancels it)


@pytest.mark.slow  # 15 s; CI keeps test_slurms_commands_run_in_a_session_of_their_own (test_slurm_input.py)
def test_a_second_ctrl_c_during_the_squeue_that_finds_the_interrupted_sbatchs_job_leaves_it_not(
    etcd, run_id, tmp_path, procs, slurm
):
    """A terminal's second Ctrl-C goes to erm launch's whole process group: the squeue that looks for the
    job whose sbatch the first one interrupted runs in a session of its own, so it still answers, and
    the job is cancelled."""
    env = held_sbatch(tmp_path, slurm, 1)
    slow = tmp_path / "slow"
    body = f'[ -e {slow} ] && touch {tmp_path}/in-squeue && sleep 3\nexec {find("squeue")} "$@"\n'
    env = tool_env(tmp_path, "squeue", body, env)
    extra = ["--python", holder(tmp_path, ignore_term=True), "--stop-grace", "300"]
    p = launch(tmp_path, slurm, etcd, run_id, "1", extra=extra, env=env)
    procs.append(p)
    wait_until(lambda: (tmp_path / "held").exists(), 60, "sbatch hanging after Slurm took its job", [p])
    took = (tmp_path / "took").read_text().strip()
    slow.touch()
    interrupt(p, "ctrl-c")  # lands in sbatch too
    wait_until(lambda: (tmp_path / "in-squeue").exists(), 60, "the squeue that looks for its job", [p])
    interrupt(p, "ctrl-c")  # the whole group again: that squeue included
    assert p.wait(60) == 130, p.output()[-3000:]
    out = p.output()
    assert AGAIN in out and "Traceback" not in out, out[-3000:]
    assert "cannot list Slurm's jobs" not in out and re.search(rf"stopping .*\b{took}\b", out), out[-3000:]
    assert run_jobs(slurm, run_id) == [], out[-3000:]
    assert took in slurm.ended_jobs()


# two signals within the first pass (11 s); CI keeps the second signal of
# test_an_interrupted_sbatchs_job_is_stopped_and_a_second_signal_cancels_at_once
@pytest.mark.slow
def test_a_second_and_third_signal_during_the_first_sigterm_pass_still_cancel_every_job(
    etcd, run_id, tmp_path, procs, slurm
):
    """Both land while the graceful stop's first scancel --signal=TERM runs (slow here, as on a busy
    slurmctld): the hurried stop is done before erm launch returns, and the graceful pass goes no
    further."""
    body = (
        f'echo "$*" >> {tmp_path}/scancel\n'
        f'case " $* " in *" --signal=TERM "*) touch {tmp_path}/in-signal; sleep 3;; esac\n'
        f'exec {find("scancel")} "$@"\n'
    )
    env = tool_env(tmp_path, "scancel", body, slurm.env())
    extra = ["--python", holder(tmp_path, ignore_term=True), "--stop-grace", "300"]
    p = launch(tmp_path, slurm, etcd, run_id, "2", extra=extra, env=env)
    procs.append(p)
    wait_until(lambda: p.output().count(" runs on ") == 2, 60, "both node jobs running", [p])
    jobs = sorted(j["id"] for j in run_jobs(slurm, run_id))
    os.kill(p.pid, signal.SIGTERM)
    wait_until(lambda: (tmp_path / "in-signal").exists(), 60, "the first scancel --signal=TERM", [p])
    os.kill(p.pid, signal.SIGTERM)
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(60) == 130, p.output()[-3000:]
    out = p.output()
    assert AGAIN in out and "Traceback" not in out, out[-3000:]
    calls = (tmp_path / "scancel").read_text().splitlines()
    assert sum("--signal=TERM" in c for c in calls) == 1, calls  # the graceful pass stopped there
    assert any(sorted(c.split()) == jobs for c in calls), calls  # the hurried scancel of every job
    wait_until(lambda: run_jobs(slurm, run_id) == [], 60, "the cancelled jobs gone", [p])


def test_a_restarted_launcher_interrupted_before_its_executor_names_the_runs_jobs_it_found(
    run_id, tmp_path, procs, slurm
):
    """A job of the run is in Slurm before erm launch starts (a restarted launcher's, to adopt): an
    interrupt before the executor runs leaves it, and erm launch names it instead of saying none is left.
    The etcd endpoint never answers: the signal lands once ermrun's parser thread (which loads torch, then
    connects to etcd) waits for it, after erm launch listed the run's jobs."""
    import socket
    from types import SimpleNamespace

    from tests.slurm.helpers import run_options

    options = run_options(run_id)
    named = (f"--job-name={options.job_name}", f"--comment={options.comment}")
    out = slurm.cmd("sbatch", "--parsable", *named, "--output=/dev/null", "--wrap", "sleep 120").stdout
    earlier = out.strip().split(";")[0]
    body = f'{find("squeue")} "$@" || exit $?\ntouch {tmp_path}/listed\n'
    env = tool_env(tmp_path, "squeue", body, slurm.env())
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(60)
        etcd = SimpleNamespace(endpoint=f"127.0.0.1:{silent.getsockname()[1]}")
        p = launch(tmp_path, slurm, etcd, run_id, "1", env=env)
        procs.append(p)
        with silent.accept()[0]:  # the parser thread connecting: it never gets an answer
            wait_until(lambda: (tmp_path / "listed").exists(), 60, "erm launch listing the run's jobs", [p])
            os.kill(p.pid, signal.SIGTERM)
            assert p.wait(60) == 130, p.output()[-3000:]
    out = p.output()
    assert "Traceback" not in out and "none of them any more" not in out, out[-3000:]
    assert (
        f"job(s) {earlier} of the run were running before this launcher: `erm launch` again adopts them, "
        f"or scancel {earlier}"
    ) in out, out[-3000:]
    assert [j["id"] for j in run_jobs(slurm, run_id)] == [earlier]  # left, as said (the fixture cancels it)


def test_a_hangup_ends_the_run_unless_erm_launch_was_started_with_nohup(etcd, run_id, tmp_path, procs, slurm):
    """SIGHUP: the session that started erm launch ended (an ssh connection to the login node dropped).
    The run ends as on Ctrl-C, rather than leave its node jobs without a launcher; under nohup the hangup
    stays ignored and the run goes on."""
    extra = ["--python", holder(tmp_path, ignore_term=False)]
    kept = f"{run_id}-nohup"
    # SIGHUP at its default, whatever this test inherited (a suite run under nohup ignores it)
    hup_default = (
        sys.executable,
        "-c",
        "import os, signal, sys; signal.signal(signal.SIGHUP, signal.SIG_DFL); "
        "os.execv(sys.argv[1], sys.argv[1:])",
    )
    hung = launch(tmp_path, slurm, etcd, run_id, "1", extra=extra, log="hung.log", prefix=hup_default)
    nohup = launch(tmp_path, slurm, etcd, kept, "1", extra=extra, log="nohup.log", prefix=("nohup",))
    procs += [hung, nohup]
    for p, rid in ((hung, run_id), (nohup, kept)):
        wait_until(lambda rid=rid: [j["state"] for j in run_jobs(slurm, rid)] == ["RUNNING"], 60, rid, [p])
    os.kill(hung.pid, signal.SIGHUP)
    os.kill(nohup.pid, signal.SIGHUP)
    assert hung.wait(60) == 130, hung.output()[-3000:]
    assert "Slurm lists none of them any more" in hung.output() and "Traceback" not in hung.output()
    assert run_jobs(slurm, run_id) == []
    assert nohup.popen.poll() is None, nohup.output()[-3000:]  # still running, its node job too
    assert [j["state"] for j in run_jobs(slurm, kept)] == ["RUNNING"]
    os.kill(nohup.pid, signal.SIGTERM)
    assert nohup.wait(60) == 130, nohup.output()[-3000:]
    assert run_jobs(slurm, kept) == []
