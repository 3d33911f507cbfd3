"""`erm plan` and `erm simulate`: outputs, and bad input answered with a message and exit 2, no traceback."""

import json

import pytest

from launcher.erm import main

from .helpers import JOB


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_prints_the_stages_and_why(tmp_path, capsys):
    desc = {
        **JOB,
        "min_nodes": 1,
        "max_nodes": 8,
        "observations": [{"world": 2, "step_s": 0.1}, {"world": 4, "step_s": 0.066}],
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(desc))
    rc, out, err = run(capsys, "plan", str(path))
    assert rc == 0 and not err
    assert "stage 1" in out and "cold start" in out and "stage 2" in out and "<- target" in out
    rc, out, _ = run(capsys, "plan", str(path), "--json", "--max-nodes", "6")
    data = json.loads(out)
    assert rc == 0 and data["max_nodes"] == 6 and 1 <= data["stage2"]["target_world"] <= 6


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"name": "x",\n "tables": [}', ":2:"),
        (json.dumps({**JOB, "tables": [{"rows": 5}]}), "tables[0]: missing field 'dim'"),
        (json.dumps({**JOB, "history": [{"v": 1}]}), "history[0]"),
        (json.dumps({**JOB, "min_nodes": 4, "max_nodes": 2}), "'max_nodes'"),
        (json.dumps({**JOB, "observations": [{"world": 0, "step_s": 1}]}), "observations[0]: field 'world'"),
    ],
)
def test_plan_rejects_bad_descriptions_with_a_message(tmp_path, capsys, text, needle):
    path = tmp_path / "bad.json"
    path.write_text(text)
    rc, out, err = run(capsys, "plan", str(path))
    assert rc == 2 and needle in err and "bad.json" in err and "Traceback" not in err + out


def test_plan_checks_and_uses_the_jobs_planner_settings_as_ermrun_does(tmp_path, capsys):
    """The job's "planner" object is what the live leader plans with: erm plan refuses what ermrun --job
    refuses, naming the field, and plans with the settings it accepts (here the cold start's size)."""
    path = tmp_path / "job.json"
    path.write_text(json.dumps({**JOB, "min_nodes": 1, "max_nodes": 8, "planner": {"window": "x"}}))
    rc, out, err = run(capsys, "plan", str(path))
    assert rc == 2 and "planner.window: expected a number >= 0" in err and "Traceback" not in err + out
    sizes = []
    for nodes in (3, 5):
        path.write_text(
            json.dumps({**JOB, "min_nodes": 1, "max_nodes": 8, "planner": {"cold_start_nodes": nodes}})
        )
        rc, out, err = run(capsys, "plan", str(path), "--json")
        assert rc == 0 and not err, err
        sizes.append(json.loads(out)["stage1"]["world"])
    assert sizes == [3, 5]


def test_plan_missing_file(capsys, tmp_path):
    rc, _, err = run(capsys, "plan", str(tmp_path / "nope.json"))
    assert rc == 2 and "cannot read" in err


def test_simulate_writes_json_and_plots(tmp_path, capsys):
    out_dir = tmp_path / "sim"
    trace = tmp_path / "trace.csv"
    argv = [
        "simulate",
        "--generate",
        "12",
        "--machines",
        "4",
        "--seed",
        "3",
        "--out",
        str(out_dir),
        "--write-trace",
        str(trace),
    ]
    rc, out, err = run(capsys, *argv)
    assert rc == 0, err
    data = json.loads((out_dir / "result.json").read_text())
    assert set(data["policies"]) == {"static", "optimus", "ours"} and data["v"] == 1
    assert data["policies"]["static"]["jobs"] == 12
    for png in ("jct_cdf.png", "utilisation.png", "cluster_allocation.png", "jct_ratio_cdf.png"):
        assert (out_dir / png).read_bytes()[:4] == b"\x89PNG"
    page = (out_dir / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4 and "per-job JCT / static p90" in page
    assert "mean JCT (h)" in out and "jobs slowed > 5%" in out
    for name in ("static", "optimus", "ours"):
        regret = data["policies"][name]["jct_ratio_vs_static"]
        assert regret["jobs"] == 12 and 0 <= regret["share_slowed_25pct"] <= regret["share_slowed_5pct"] <= 1
    assert data["policies"]["static"]["jct_ratio_vs_static"]["p90"] == 1.0
    # the written trace replays to the same figures
    rc, out2, _ = run(
        capsys,
        "simulate",
        "--trace",
        str(trace),
        "--machines",
        "4",
        "--seed",
        "3",
        "--out",
        str(out_dir),
        "--no-plots",
    )
    figures = [line for line in out.splitlines()[1:] if not line.startswith("wrote")]
    assert rc == 0 and [line for line in out2.splitlines()[1:] if not line.startswith("wrote")] == figures


def test_simulate_bad_trace_names_the_line(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    assert (
        main(
            [
                "simulate",
                "--generate",
                "3",
                "--machines",
                "4",
                "--out",
                str(tmp_path / "o"),
                "--write-trace",
                str(trace),
                "--no-plots",
            ]
        )
        == 0
    )
    capsys.readouterr()
    lines = trace.read_text().splitlines()
    header = lines[0].split(",")
    row = lines[2].split(",")
    row[header.index("gpus_per_node")] = "two"
    lines[2] = ",".join(row)
    trace.write_text("\n".join(lines) + "\n")
    rc, out, err = run(capsys, "simulate", "--trace", str(trace), "--out", str(tmp_path / "o2"))
    assert rc == 2 and "trace.csv:3: field 'gpus_per_node'" in err and "Traceback" not in err + out


def test_simulate_rejects_unknown_policy(capsys):
    rc, _, err = run(capsys, "simulate", "--policies", "static,magic")
    assert rc == 2 and "magic" in err


def test_simulate_family(tmp_path, capsys):
    rc, _, err = run(capsys, "simulate", "--family", "tiny-jobs")
    assert rc == 2 and "--family: unknown 'tiny-jobs'" in err and "right-sized" in err
    csv_path = tmp_path / "t.csv"
    rc, _, err = run(
        capsys,
        "simulate",
        "--generate",
        "6",
        "--family",
        "comm-bound",
        "--machines",
        "8",
        "--policies",
        "static",
        "--no-plots",
        "--out",
        str(tmp_path / "o"),
        "--write-trace",
        str(csv_path),
    )
    assert rc == 0, err
    from elastic_rm.planner.sim.trace import load_trace

    assert all(j.dim in (128, 256) for j in load_trace(str(csv_path)))
