"""What `erm launch --slurm` refuses before it submits anything, and how it reads Slurm's answers."""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess

import pytest

from elastic_rm.launch.slurm_cli import Slurm, SlurmError, parse_jobs
from elastic_rm.launch.slurm_job import SlurmOptions
from launcher.erm import main as erm_main
from tests.conftest import BIN, REPO
from tests.slurm.helpers import CONF, WORKER, run_jobs, run_options, tool_env


def erm_launch_argv(tmp_path, etcd_endpoint: str, run_id: str, *extra: str) -> list[str]:
    return [
        os.path.join(BIN, "erm"),
        "launch",
        "--slurm",
        *extra,
        "--slurm-output",
        str(tmp_path / "%x-%j.out"),
        "--workdir",
        REPO,
        "--nnodes",
        "1",
        "--rdzv-endpoint",
        etcd_endpoint,
        "--rdzv-id",
        run_id,
        "--rdzv-conf",
        CONF,
        WORKER,
    ]


def erm_launch(tmp_path, env, etcd_endpoint: str, run_id: str, *extra: str) -> subprocess.CompletedProcess:
    argv = erm_launch_argv(tmp_path, etcd_endpoint, run_id, *extra)
    return subprocess.run(argv, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=120)


@pytest.fixture
def erm_launch_here(tmp_path, monkeypatch, capfd):
    """erm_launch's command in this process (no seconds of torch import for ermrun's parser each): its
    exit status and output as a CompletedProcess. ``env`` is applied to this process's environment, the
    working directory is ``tmp_path``. For refusals that do not depend on how long the parser takes:
    test_flags_ermruns_parser_refuses_leave_no_node_job keeps a real process where the first node job
    is submitted while the parser loads (and tests/launch/test_erm_console.py the `erm` entry point's
    exit status and message)."""

    def launch(env, etcd_endpoint: str, run_id: str, *extra: str) -> subprocess.CompletedProcess:
        for name in set(os.environ) | set(env):
            if name not in env:
                monkeypatch.delenv(name)
            elif os.environ.get(name) != env[name]:
                monkeypatch.setenv(name, env[name])
        monkeypatch.chdir(tmp_path)
        capfd.readouterr()
        argv = erm_launch_argv(tmp_path, etcd_endpoint, run_id, *extra)
        code = erm_main(argv[1:])
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    return launch


def test_no_slurm_on_path_is_a_clear_error(run_id, etcd, erm_launch_here):
    env = {**os.environ, "PATH": BIN}  # the virtualenv's bin only: no sbatch
    r = erm_launch_here(env, etcd.endpoint, run_id)
    assert r.returncode == 2, r.stderr
    assert "sbatch, squeue, scancel, sinfo not on PATH" in r.stderr and "login node" in r.stderr


def test_an_unknown_partition_names_the_partitions_slurm_has(run_id, etcd, slurm, erm_launch_here):
    r = erm_launch_here(slurm.env(), etcd.endpoint, run_id, "--partition", "nope")
    assert r.returncode == 2, r.stderr
    assert "Slurm has no partition nope (sinfo lists: debug, other)" in r.stderr
    assert run_jobs(slurm, run_id) == []


@pytest.mark.parametrize(
    "arg, said",
    [
        ("--gres=gpu:8", "Invalid generic resource (gres) specification"),
        pytest.param("--bogus", "unrecognized option '--bogus'", marks=pytest.mark.slow),  # a job each
    ],
)
def test_an_sbatch_refusal_is_reported_in_slurms_words_before_anything_runs(
    run_id, etcd, slurm, erm_launch_here, arg, said
):
    r = erm_launch_here(slurm.env(), etcd.endpoint, run_id, f"--slurm-arg={arg}")
    assert r.returncode == 2, r.stderr
    assert "Slurm refuses the node job: sbatch failed" in r.stderr and said in r.stderr
    assert run_jobs(slurm, run_id) == [] and slurm.jobs() == []


def _job(**over) -> dict:
    job = {
        "job_id": 7,
        "name": "erm-r1",
        "comment": "erm launch run r1",
        "job_state": "PENDING",
        "nodes": "",
        "state_reason": "Resources",
        "partition": "debug,other",
        "node_count": 2,
        "user_name": "alice",
        "exit_code": 256,
    }
    return {**job, **over}


def test_squeue_json_is_read_as_22_05_and_later_releases_print_it():
    old = parse_jobs(json.dumps({"jobs": [_job()]}))[0]
    assert (old.job_id, old.partitions, old.node_count, old.exit_code) == ("7", ("debug", "other"), 2, 1)
    new = parse_jobs(
        json.dumps(
            {
                "jobs": [
                    _job(
                        job_state=["RUNNING"],
                        node_count={"set": True, "number": 3},
                        exit_code={"return_code": {"number": 0}},
                    )
                ]
            }
        )
    )[0]
    assert (new.state, new.node_count, new.exit_code, new.ended) == ("RUNNING", 3, 0, False)
    flagged = _job(job_state=["PENDING", "REQUEUED"])  # a base state, then flags
    killed = _job(
        job_state=["FAILED"],
        exit_code={"status": ["SIGNALED"], "return_code": {"number": 0}, "signal": {"id": {"number": 9}}},
    )
    jobs = parse_jobs(json.dumps({"jobs": [flagged, killed]}))
    assert [(j.state, j.exit_code) for j in jobs] == [("PENDING", 1), ("FAILED", 137)]
    named = _job(state_reason="ReqNodeNotAvail", state_description="ReqNodeNotAvail, UnavailableNodes:b1")
    other = _job(state_description="Nodes required for job are DOWN, DRAINED or reserved for jobs in ...")
    reasons = [j.reason for j in parse_jobs(json.dumps({"jobs": [named, other]}))]
    assert reasons == ["ReqNodeNotAvail, UnavailableNodes:b1", "Resources"]  # as squeue --json prints them
    with pytest.raises(SlurmError, match="other than its job list"):
        parse_jobs("sbatch: error: something")


def test_the_batch_script_execs_ermrun_with_the_slurm_node_as_node_id(tmp_path):
    opts = SlurmOptions(
        run_id="r1",
        partition="gpu",
        sbatch_args=("--time=1:00:00",),
        exclude=("b9",),
        output="/o/%j.out",
        workdir="/w d",
        python="/py",
        ermrun_flags=("--nnodes", "1:4"),
        script=("train.py", "--lr", "0.1"),
        env=(("A", "x y"),),
    )
    script = opts.batch_script()
    last = shlex.split(script.splitlines()[-1])
    assert last[:2] == ["exec", "env"] and "A=x y" in last and "ERM_SLURM=0" in last
    i = last.index("/py")
    assert last[i:] == [
        "/py",
        "-m",
        "launcher.ermrun",
        "--nnodes",
        "1:4",
        "--node-id",
        "$SLURMD_NODENAME",
        "train.py",
        "--lr",
        "0.1",
    ]
    assert "cd '/w d'" in script
    options = opts.sbatch_options(["b2", "b1"])
    assert "--exclude=b1,b2,b9" in options and "--job-name=erm-r1" in options
    assert "--partition=gpu" in options and options[-1] == "--time=1:00:00"  # the user's last: they win


def test_the_stragglers_a_round_drops_are_its_records_field():
    from elastic_rm.wire.records import STRAGGLERS, RoundRecord

    rnd = RoundRecord(
        round=3, members=("b1", "b7"), reason="straggler(s) b3 replaced by b7", extra={STRAGGLERS: ["b3"]}
    )
    back = RoundRecord.parse("/r/round", rnd.to_json())
    assert back.stragglers == ("b3",)
    assert RoundRecord(round=1, members=("b1",)).stragglers == ()  # written by a leader without the field
    assert RoundRecord(round=1, members=("b1",), extra={STRAGGLERS: "b3"}).stragglers == ()  # malformed


@pytest.mark.parametrize("how", [["--job", "job.json"], ["--rdzv-conf", f"{CONF},job_file=job.json"]])
def test_the_job_descriptions_request_is_read_from_job_or_rdzv_conf_job_file(
    tmp_path, run_id, etcd, slurm, how, monkeypatch
):
    """Before the leader's first demand the run asks for the description's request, however it is given."""
    from launcher.commands.launch_plan import ermrun_command_line
    from launcher.commands.launch_slurm import check_slurm, job_file_of
    from launcher.erm import build_parser

    (tmp_path / "job.json").write_text(json.dumps({"request": {"nodes": 3}}))
    argv = ["launch", "--slurm", "--workdir", str(tmp_path), "--nnodes", "1:4"]
    argv += ["--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, *how, WORKER]
    args = build_parser("launch").parse_args(argv)
    ns, flags, script = ermrun_command_line(args)
    monkeypatch.setenv("SLURM_CONF", slurm.env()["SLURM_CONF"])
    _, options, _ = check_slurm(args, ns.rdzv_id, flags, script, job_file_of(ns))
    assert options.requested_nodes == 3
    assert run_jobs(slurm, run_id) == []  # checked with --test-only: nothing submitted


@pytest.mark.parametrize(
    "content,said",
    [
        (None, "cannot read the job description"),
        ("{not json", "is not JSON"),
        ("[1, 2]", "not a JSON object with a 'request' object"),
    ],
)
def test_a_job_file_named_but_unreadable_on_the_login_node_is_refused_before_any_submit(
    tmp_path, run_id, etcd, slurm, content, said
):
    """Without the description's request every node job past --nnodes' minimum would be growth: refused,
    saying what to do, before anything is submitted."""
    from launcher.commands.launch_plan import ermrun_command_line
    from launcher.commands.launch_slurm import check_slurm, job_file_of
    from launcher.erm import build_parser

    if content is not None:
        (tmp_path / "job.json").write_text(content)
    argv = ["launch", "--slurm", "--workdir", str(tmp_path), "--nnodes", "1:4"]
    argv += ["--rdzv-endpoint", etcd.endpoint, "--rdzv-id", run_id, "--job", "job.json", WORKER]
    args = build_parser("launch").parse_args(argv)
    ns, flags, script = ermrun_command_line(args)
    with pytest.raises(ValueError, match=said) as err:
        check_slurm(args, ns.rdzv_id, flags, script, job_file_of(ns))
    assert str(tmp_path / "job.json") in str(err.value)
    assert run_jobs(slurm, run_id) == []


def _run_jobs_ended(cluster, run_id) -> list[dict]:
    """The run's node jobs in Slurm's completion log: jobs that were submitted and ended."""
    return [f for f in cluster.ended_jobs().values() if f"erm-{run_id}" in (f.get("Name"), f.get("JobName"))]


@pytest.mark.parametrize(
    "extra, said, submitted",
    [
        # erm launch's own reading of the flags (read_first) ignores --max-restarts: the first node job
        # is submitted while the parser loads torch, and cancelled once the parser refuses
        (["--max-restarts", "many"], "argument --max-restarts/--max_restarts: invalid int value: 'many'", 1),
        # read_first leaves a rendezvous backend to the parser: nothing is submitted before it refused
        (
            ["--rdzv-backend", "c10d"],
            "erm launch runs the elastic-rm rendezvous; remove --rdzv-backend c10d",
            0,
        ),
    ],
)
def test_flags_ermruns_parser_refuses_leave_no_node_job(
    tmp_path, run_id, etcd, slurm, erm_launch_here, extra, said, submitted
):
    """ermrun's parser reads the flags while the run's first node jobs are submitted: its refusal
    cancels them, and erm launch exits once Slurm lists none of them running. A real process where a
    job goes in while the parser loads torch (in this process torch is loaded: the parser would be
    first); in this process where nothing is submitted before the parser's answer."""
    launch = functools.partial(erm_launch, tmp_path) if submitted else erm_launch_here
    r = launch(slurm.env(), etcd.endpoint, run_id, *extra)
    assert r.returncode == 2, r.stderr
    assert said in r.stderr, r.stderr
    assert run_jobs(slurm, run_id) == []
    assert len(_run_jobs_ended(slurm, run_id)) == submitted, slurm.ended_jobs()


@pytest.mark.parametrize(
    "extra, said",
    [
        (["--host-failures", "0"], "--host-failures must be >= 1, got 0"),
        (["--blacklist-cooldown", "-1"], "--blacklist-cooldown must be >= 0"),
        (["--events-file", "/proc/erm/events.jsonl"], "--events-file /proc/erm/events.jsonl: cannot open it"),
        (["--slurm-arg=--comment=project-42"], "--slurm-arg=--comment=project-42: sbatch's --comment cannot"),
        pytest.param(["--exclude", "b[1-"], "--exclude b[1-: unbalanced brackets", marks=pytest.mark.slow),
    ],
)
def test_a_bad_launcher_setting_is_refused_before_any_node_job(
    run_id, etcd, slurm, erm_launch_here, extra, said
):
    r = erm_launch_here(slurm.env(), etcd.endpoint, run_id, *extra)
    assert r.returncode == 2, r.stderr
    assert said in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert run_jobs(slurm, run_id) == [] and _run_jobs_ended(slurm, run_id) == []


def test_an_abort_cancels_the_runs_jobs_submitted_since_and_leaves_those_listed_before(run_id, slurm):
    """A job whose sbatch was interrupted after Slurm took it has no id in erm launch: the run's jobs
    squeue lists that were not there before the first submission are cancelled; earlier ones (a
    restarted erm launch's to adopt) are left."""
    from elastic_rm.launch.interrupts import Interrupts
    from launcher.commands.launch_slurm import FirstJobs, cancel_first

    options = run_options(run_id)

    def sleeper() -> str:
        named = (f"--job-name={options.job_name}", f"--comment={options.comment}")
        return slurm.cmd("sbatch", "--parsable", *named, "--output=/dev/null", "--wrap", "sleep 120").stdout

    earlier = sleeper().strip().split(";")[0]
    first = FirstJobs(before={earlier})
    lost = sleeper().strip().split(";")[0]  # its id never came back to erm launch
    assert cancel_first((Slurm(env=slurm.env()), options, None), first, 1.0, Interrupts()) == []
    assert [j["id"] for j in run_jobs(slurm, run_id)] == [earlier], f"{lost} should be cancelled"


def test_a_poll_interval_longer_than_the_queue_keys_refresh_is_refused(run_id, etcd, slurm, erm_launch_here):
    r = erm_launch_here(slurm.env(), etcd.endpoint, run_id, "--poll-interval", "6")
    assert r.returncode == 2, r.stderr
    assert "--poll-interval 6: with --slurm at most 5s" in r.stderr, r.stderr
    assert run_jobs(slurm, run_id) == []


def test_slurms_commands_run_in_a_session_of_their_own(tmp_path):
    """A terminal's Ctrl-C goes to erm launch's process group: not to the squeue or scancel of its stop."""
    env = tool_env(
        tmp_path, "squeue", f"ps -o sid= -p $$ > {tmp_path}/sid\necho '{{\"jobs\": []}}'\n", os.environ
    )
    assert Slurm(env=env).jobs() == []
    sid = int((tmp_path / "sid").read_text())
    assert sid != os.getsid(0) and sid != os.getpgid(0)


def test_a_slurm_command_past_its_timeout_or_interrupted_is_killed(tmp_path):
    import signal
    import threading

    from elastic_rm.launch.interrupts import Interrupts
    from tests.e2e.helpers import wait_until
    from tests.slurm.helpers import gone

    pid_file = tmp_path / "pid"
    body = f"echo $$ > {pid_file}.tmp && mv {pid_file}.tmp {pid_file}\nexec sleep 60\n"
    env = tool_env(tmp_path, "squeue", body, os.environ)

    def pid() -> int:
        value = int(pid_file.read_text())
        pid_file.unlink()
        return value

    with pytest.raises(SlurmError, match="did not answer within 2s"):
        Slurm(env=env, timeout_s=2).jobs()
    killed = pid()
    wait_until(lambda: gone(killed), 10, "the squeue past its timeout killed", [])

    def ctrl_c() -> None:
        for _ in range(600):  # bounded: 60 s
            if pid_file.exists():
                break
            threading.Event().wait(0.1)
        os.kill(os.getpid(), signal.SIGINT)

    with Interrupts(), pytest.raises(KeyboardInterrupt):
        threading.Thread(target=ctrl_c, daemon=True).start()
        Slurm(env=env).jobs()
    killed = pid()
    wait_until(lambda: gone(killed), 10, "the interrupted squeue killed", [])


def test_slurm_args_that_would_unmake_a_node_job_are_refused_and_the_rest_pass():
    from launcher.commands.launch_slurm import _sbatch_args

    allowed = [
        "--time=4:00:00",
        "--gres=gpu:8",
        "-A",
        "proj",
        "--qos=high",
        "--no-requeue",
        "--nice=5",
        "-t",
        "9",
    ]
    assert _sbatch_args(allowed) == tuple(allowed)
    for arg, option in [
        ("--comment=x", "--comment"),
        ("--comm=x", "--comment"),  # sbatch takes an unambiguous prefix
        ("-Jx", "--job-name"),
        ("--job-name=x", "--job-name"),
        ("-N2", "--nodes"),
        ("--array=1-4", "--array"),
        ("--requeue", "--requeue"),
        ("-p", "--partition"),
        ("--output=o", "--output"),
    ]:
        with pytest.raises(ValueError, match=f"--slurm-arg={arg}: sbatch's {option} cannot be set here"):
            _sbatch_args([arg])


def test_exclude_takes_slurms_host_list():
    from launcher.commands.launch_slurm import _exclude_hosts

    assert _exclude_hosts("b[1-2,4],c7") == ("b1", "b2", "b4", "c7")
    assert _exclude_hosts(" b1, b2 ") == ("b1", "b2")
    assert _exclude_hosts("") == ()


def test_a_pending_job_array_waits_for_a_node_per_task_up_to_its_throttle():
    """Slurm lists a pending array as one record (22.05: ``array_task_string`` "1-6"): its tasks each
    want the record's nodes, at most its throttle (``%N``) at once."""
    records = [
        _job(job_id=3, array_task_string="1-6", node_count=1),
        _job(job_id=4, array_task_string="1-10:3%2", node_count=2),
        _job(job_id=5, array_task_string="", node_count=2),
    ]
    jobs = parse_jobs(json.dumps({"jobs": records}))
    assert [(j.array_tasks, j.node_count) for j in jobs] == [(6, 1), (2, 2), (1, 2)]


def test_a_stop_waits_for_the_clusters_kill_wait_after_scancel(tmp_path, slurm):
    """scancel's SIGKILL comes KillWait after its SIGTERM: the stop waits that long plus 10 s for the jobs
    to leave squeue, with the cluster's own KillWait (the test cluster's: 2 s), read once, and Slurm's
    default of 30 s where scontrol cannot say."""
    assert Slurm(env=slurm.env()).cancel_wait_s() == 12.0
    calls = tmp_path / "calls"
    printed = f"echo x >> {calls}\necho 'KillWait                = 7 sec'\n"
    counted = Slurm(env=tool_env(tmp_path, "scontrol", printed, slurm.env()))
    assert counted.cancel_wait_s() == 17.0 and counted.cancel_wait_s() == 17.0
    assert calls.read_text() == "x\n"  # read once
    failing = tool_env(tmp_path, "scontrol", "echo 'slurm_load_ctl_conf error' >&2\nexit 1\n", slurm.env())
    assert Slurm(env=failing).cancel_wait_s() == 40.0
