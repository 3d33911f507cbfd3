"""ermrun inside srun: node count, run id, node id and etcd address from a (faked) Slurm environment."""

from __future__ import annotations

import os

import pytest

from elastic_rm.etcd.client import EtcdClient
from elastic_rm.launch.slurm import SlurmError, apply_slurm, expand_hostlist, node_list
from elastic_rm.wire.keyspace import Keyspace
from elastic_rm.wire.records import RoundRecord
from launcher.ermrun import build_parser
from tests.e2e.helpers import ermrun, records

SRUN = {
    "SLURM_JOB_ID": "4242",
    "SLURM_STEP_ID": "0",
    "SLURM_STEP_NUM_NODES": "3",
    "SLURM_JOB_NUM_NODES": "5",
    "SLURM_STEP_NODELIST": "node[01-02],gpu7",
    "SLURMD_NODENAME": "node02",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "0",
    "PATH": "/nonexistent",  # no scontrol: the node list is expanded by us
}


@pytest.mark.parametrize(
    "text,hosts",
    [
        ("node[01-03],gpu7", ["node01", "node02", "node03", "gpu7"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("a[1,3-4],b[09-11]", ["a1", "a3", "a4", "b09", "b10", "b11"]),
        ("solo", ["solo"]),
    ],
)
def test_slurm_host_lists_expand_like_scontrol(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[1-", "node[3-1]", "node[a-b]", ""])
def test_a_malformed_host_list_is_an_error_naming_it(text):
    with pytest.raises(SlurmError, match="Slurm node list"):
        expand_hostlist(text)


def parse(*flags: str):
    parser = build_parser()
    return parser.parse_args([*flags, "train.py"]), parser


def test_inside_srun_the_defaults_come_from_slurm():
    args, parser = parse()
    taken = apply_slurm(args, parser, SRUN)
    assert (args.nnodes, args.rdzv_id, args.node_id) == ("3", "slurm-4242-0", "node02")
    assert args.rdzv_endpoint == "node01:2379"  # the first node of the step runs `erm etcd`
    assert len(taken) == 4


def test_flags_given_win_and_outside_srun_nothing_changes():
    args, parser = parse("--nnodes", "2:3", "--rdzv-endpoint", "etcd1:2379", "--node-id", "mine")
    apply_slurm(args, parser, SRUN)
    assert (args.nnodes, args.rdzv_endpoint, args.node_id, args.rdzv_id) == (
        "2:3",
        "etcd1:2379",
        "mine",
        "slurm-4242-0",
    )
    for env in ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, {**SRUN, "ERM_SLURM": "0"}):
        args, parser = parse()
        assert apply_slurm(args, parser, env) == [] and args.nnodes == "1:1" and args.node_id is None


def test_a_second_task_on_a_node_gets_its_own_id_and_scontrol_is_used_when_present(tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\necho from-scontrol-a\necho from-scontrol-b\n")
    scontrol.chmod(0o755)
    env = {**SRUN, "SLURM_LOCALID": "1", "PATH": str(tmp_path)}
    args, parser = parse()
    apply_slurm(args, parser, env)
    assert args.node_id == "node02-1" and args.rdzv_endpoint == "from-scontrol-a:2379"
    assert node_list(env) == ["from-scontrol-a", "from-scontrol-b"]


@pytest.mark.slow
def test_two_ermruns_in_a_faked_srun_step_form_one_job(etcd, tmp_path, procs):
    """Nothing but the Slurm variables tells the two agents the node count, the run id and their ids."""
    env = {
        **SRUN,
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NODELIST": "slurmn[1-2]",
        "PATH": os.environ["PATH"],
    }
    env["SLURM_JOB_ID"] = f"{os.getpid()}{len(str(tmp_path))}"
    conf = [
        "--rdzv-endpoint",
        etcd.endpoint,
        "--rdzv-conf",
        "lease_ttl=2,last_call_timeout=0.5,join_timeout=60",
    ]
    nodes = [
        ermrun(
            tmp_path,
            f"slurmn{i}",
            conf,
            steps_max=10,
            extra_env={**env, "SLURMD_NODENAME": f"slurmn{i}", "SLURM_PROCID": str(i - 1)},
        )
        for i in (1, 2)
    ]
    procs.extend(nodes)
    for p in nodes:
        assert p.wait(120) == 0, p.output()[-3000:]
    starts = [r for n in ("slurmn1", "slurmn2") for r in records(tmp_path, n) if r.get("start")]
    assert sorted(r["rank"] for r in starts) == [0, 1] and {r["world"] for r in starts} == {2}
    assert {r["env"]["TORCHELASTIC_RUN_ID"] for r in starts} == {f"slurm-{env['SLURM_JOB_ID']}-0"}
    run = f"slurm-{env['SLURM_JOB_ID']}-0"
    with EtcdClient(etcd.endpoint) as client:
        first = RoundRecord.parse("record", client.get(Keyspace("/elastic-rm", run).record(1)).value)
    assert sorted(first.members) == ["slurmn1", "slurmn2"]  # the node ids are the Slurm node names
