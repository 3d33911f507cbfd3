"""The demo's and the soak's figures land in <workdir>/<name>.json, in the shape the docs quote."""

from __future__ import annotations

import json

from elastic_rm.obs.results_file import demo_figures, soak_figures, write_results_file


def test_the_demo_s_downtimes_throughput_and_checks_are_written_with_the_machine(tmp_path):
    summary = {
        "wall_s": 98.2,
        "downtime": [
            {"from": 2, "to": 3, "seconds": 10.04},
            {"from": 3, "to": 3, "seconds": 6.46},
            {"from": 3, "to": 2, "seconds": 6.93},
        ],
        "throughput": {2: 410.0, 3: 350.5},
        "rounds": [{"round": 1}, {"round": 2}, {"round": 3}, {"round": 4}],
        "checks": [{"what": "a", "ok": True}, {"what": "b", "ok": True}, {"what": "c", "ok": False}],
    }
    path = write_results_file("demo", demo_figures(summary), tmp_path)
    assert path == tmp_path / "demo.json" and not list(tmp_path.glob("*.tmp"))
    got = json.loads(path.read_text())
    assert got["benchmark"] == "demo" and got["machine"]["cpus"] >= 1 and got["time"].endswith("Z")
    assert [d["change"] for d in got["downtime"]] == ["2->3", "3->3", "3->2"]
    assert [d["seconds"] for d in got["downtime"]] == [10.04, 6.46, 6.93]
    assert got["throughput_samples_per_s"] == {"2": 410.0, "3": 350.5}
    assert (got["wall_s"], got["rounds"], got["checks"], got["checks_passed"]) == (98.2, 4, 3, 2)


def test_the_soak_s_faults_downtimes_and_final_state_are_summarised():
    record = {
        "seed": 1,
        "minutes": 30.0,
        "pace": 5.0,
        "rounds": 33,
        "final_round": 33,
        "final_step": 7920,
        "restarts_checked": 40,
        "ledger_checks": 97,
        "schedule": [[3, 1, 300], [2, 301, 310], [3, 311, 7920]],
        "faults": [
            {"kind": "sigkill_node", "back_at_world_3_s_after_fault_end": 7.8},
            {"kind": "etcd_down", "back_at_world_3_s_after_fault_end": 1.6},
            {"kind": "sigkill_node", "back_at_world_3_s_after_fault_end": 10.5},
        ],
        "downtime_s": [5.5, 6.5, 7.6, 6.0],
        "state": {"checksum": "0535e8ee3df5", "checksum_value": 1.0000000000000002},
        "reference_state": {"checksum": "0535e8ee3df5", "checksum_value": 1.0},  # equal at 11 digits
    }
    got = soak_figures(record)
    assert got["faults_survived"] == 3 and got["faults_by_kind"] == {"sigkill_node": 2, "etcd_down": 1}
    assert got["back_at_world_3_s"] == {"n": 3, "median": 7.8, "min": 1.6, "max": 10.5}
    assert got["downtime_s"] == {"n": 4, "median": 6.25, "min": 5.5, "max": 7.6}
    assert (got["stretches"], got["final_step"], got["state_equals_replay"]) == (3, 7920, True)
    record["reference_state"] = {"checksum": "ffffffffffff"}
    assert soak_figures(record)["state_equals_replay"] is False


def test_the_file_goes_into_the_run_s_own_directory_made_if_missing(tmp_path):
    path = write_results_file("demo", {"wall_s": 1.0}, tmp_path / "work" / "new")
    assert path == tmp_path / "work" / "new" / "demo.json" and json.loads(path.read_text())["wall_s"] == 1.0
