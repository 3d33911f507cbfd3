"""Every figure README.md and docs/ quote agrees with its results file (benchmarks/figures.py), and the
checker itself catches a stale, unmarked or unbacked figure."""

from __future__ import annotations

import json

from benchmarks.figures import check, figures, unmarked, update

RESULT = {
    "results": {"ermrun/SIGKILL": {"median": 8.330376, "min": 7.914, "max": 8.7465}, "c10d": 47.88329},
    "pauses": [0.0652, 0.0563],
    "rate": -0.3802,
    "steps": 1173.0,
    "missing": None,
    "call_us": 52.51,
    "step_cpu_ms": {"ermrun": [9.69, 10.43]},
}


def write(tmp_path, doc: str) -> tuple:
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / "r.json").write_text(json.dumps(RESULT))
    (tmp_path / "doc.md").write_text(doc)
    return tmp_path, results


def problems(tmp_path, doc: str, tables=()) -> list[str]:
    repo, results = write(tmp_path, doc)
    return check(repo, results, ("doc.md",), tables)


def test_figures_that_agree_with_their_file_at_the_doc_s_precision_pass(tmp_path):
    doc = (
        "SIGKILL 8.33 s<!-- fig: r.json results.ermrun/SIGKILL.median --> "
        "(7.91<!-- fig: r.json results.ermrun/SIGKILL.min -->-"
        "8.75 s<!-- fig: r.json results.ermrun/SIGKILL.max -->), "
        "**8.3 s<!-- fig: r.json results.ermrun/SIGKILL.median -->**, "
        "5.7x<!-- fig: r.json results.c10d / results.ermrun/SIGKILL.median -->; "
        "56<!-- fig: r.json pauses.min in ms -->-65 ms<!-- fig: r.json pauses.max -->, "
        "-38%<!-- fig: r.json rate -->, 1,173<!-- fig: r.json steps --> steps, "
        "+447%<!-- fig: r.json results.c10d / results.ermrun/SIGKILL.max - 1 -->\n"
    )
    assert problems(tmp_path, doc) == []
    assert [f.text for f in figures("doc.md", doc, tmp_path / "results")] == [
        "8.33",
        "7.91",
        "8.75",
        "8.3",
        "5.7",
        "56",
        "65",
        "-38",
        "1,173",
        "447",
    ]


def test_a_stale_figure_fails_naming_the_file_s_value_and_update_rewrites_it(tmp_path):
    doc = "SIGKILL 8.6 s<!-- fig: r.json results.ermrun/SIGKILL.median -->"
    doc += " vs 48.5 s<!-- fig: r.json results.c10d -->\n"
    found = problems(tmp_path, doc)
    assert len(found) == 2 and "the file says 8.3 s" in found[0] and "the file says 47.9 s" in found[1], found
    assert update(tmp_path, tmp_path / "results", ("doc.md",)) == 2
    assert (tmp_path / "doc.md").read_text() == doc.replace("8.6", "8.3").replace("48.5", "47.9")
    assert check(tmp_path, tmp_path / "results", ("doc.md",), ()) == []


def test_update_writes_one_sign_when_a_signed_figure_turns_negative(tmp_path):
    repo, results = write(tmp_path, "mean JCT +3.2%<!-- fig: r.json rate --> vs static\n")
    assert update(repo, results, ("doc.md",)) == 1
    assert (tmp_path / "doc.md").read_text() == "mean JCT -38.0%<!-- fig: r.json rate --> vs static\n"


def test_a_marker_without_a_file_a_key_a_number_or_a_figure_before_it_fails(tmp_path):
    doc = (
        "a 1 s<!-- fig: nothing.json x --> b 2 s<!-- fig: r.json results.nope --> "
        "c 3 s<!-- fig: r.json missing --> d <!-- fig: r.json rate -->\n"
    )
    found = problems(tmp_path, doc)
    assert len(found) == 4, found
    assert "no results file" in found[0] and "'nope'" in found[1] and "not a number" in found[2], found
    assert "no number right before" in found[3], found


def test_a_number_in_a_results_table_without_a_marker_fails(tmp_path):
    assert unmarked("| N = 8 | 17 ms<!-- fig: r.json x --> (27 ms) | 5/5 runs | `lease_ttl=2` |") == [
        "27",
        "5",
        "5",
    ]
    assert (
        unmarked(
            "| 2 -> 3 | 8.33 s<!-- fig: r.json x --> "
            "(7.91<!-- fig: r.json y -->-8.75 s<!-- fig: r.json z -->) |"
        )
        == []
    )
    doc = "Intro 12 s, prose is free.\n\n"
    doc += "| what | figure |\n| --- | --- |\n| join, N = 8 | 17 ms (c10d 1.27 s) |\n"
    found = problems(tmp_path, doc, (("doc.md", None),))
    assert [p.split(": ")[1] for p in found] == [
        "17 in a results table has no fig marker",
        "1.27 in a results table has no fig marker",
        "quoted by no doc (an old run",
    ]


def test_every_figure_the_docs_quote_agrees_with_its_results_file():
    found = check()
    assert found == [], (
        "\n".join(found) + "\n(python -m benchmarks.figures --update rewrites them from the files)"
    )


def test_markers_in_a_code_block_are_examples_and_not_checked(tmp_path):
    doc = "```\n1.0 s<!-- fig: r.json rate -->\n```\n2.0 s<!-- fig: nothing.json y -->\n"
    found = problems(tmp_path, doc)
    assert len(found) == 2 and found[0].startswith("doc.md:4: 2.0 s"), found
    assert found[1].startswith("benchmarks/results/r.json: quoted by no doc"), found  # examples quote nothing


def test_a_value_stored_in_ms_or_us_is_compared_in_that_unit(tmp_path):
    doc = (
        "52.5 us<!-- fig: r.json call_us -->, 0.05 ms<!-- fig: r.json call_us -->, "
        "10.4 ms<!-- fig: r.json step_cpu_ms.ermrun.max -->, 9.7<!-- fig: r.json step_cpu_ms.ermrun.min -->\n"
    )
    assert problems(tmp_path, doc) == []
    assert "the file says 52.5 us" in problems(tmp_path, "60.0 us<!-- fig: r.json call_us -->\n")[0]


def test_count_is_the_length_of_a_list_of_any_kind(tmp_path):
    RESULT_WITH_NAMES = dict(RESULT, missed=["a: mean", "b: median", "c: mean"])
    results = tmp_path / "results"
    results.mkdir()
    (results / "r.json").write_text(json.dumps(RESULT_WITH_NAMES))
    (tmp_path / "doc.md").write_text("missed 3<!-- fig: r.json missed.count --> targets\n")
    assert check(tmp_path, results, ("doc.md",), ()) == []
    (tmp_path / "doc.md").write_text("missed 2<!-- fig: r.json missed.count --> targets\n")
    assert check(tmp_path, results, ("doc.md",), ()) != []


def test_a_results_file_no_doc_quotes_fails_as_a_stale_figure_does(tmp_path):
    doc = "SIGKILL 8.33 s<!-- fig: r.json results.ermrun/SIGKILL.median -->\n"
    repo, results = write(tmp_path, doc)
    assert check(repo, results, ("doc.md",), ()) == []
    (results / "old-run.json").write_text(json.dumps(RESULT))
    assert check(repo, results, ("doc.md",), ()) == [
        "benchmarks/results/old-run.json: quoted by no doc (an old run: delete it)"
    ]


def test_a_run_s_date_and_commit_are_checked_against_its_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "r.json").write_text(
        json.dumps(dict(RESULT, date="2026-12-01T17:13:16Z", commit="79126fa" + "0" * 33))
    )
    ok = (
        "| recovery | 8.33 s<!-- fig: r.json results.ermrun/SIGKILL.median --> "
        "| 2026-12-01, 79126fa<!-- run: r.json --> |\n"
    )
    (tmp_path / "doc.md").write_text(ok)
    assert (
        check(tmp_path, results, ("doc.md",), (("doc.md", None),)) == []
    )  # the date's digits need no fig marker
    (tmp_path / "doc.md").write_text(ok.replace("2026-12-01", "2026-12-02"))
    found = check(tmp_path, results, ("doc.md",), ())
    assert len(found) == 1 and "the file says 2026-12-01, 79126fa" in found[0], found
    (tmp_path / "doc.md").write_text(ok.replace("2026-12-01, 79126fa", "79126fa"))
    found = check(tmp_path, results, ("doc.md",), ())
    assert len(found) == 1 and "needs 'YYYY-MM-DD, <commit>'" in found[0], found


def test_a_named_spec_is_used_by_its_name_and_a_missing_name_fails(tmp_path):
    doc = (
        "| join | 8.33 s<!-- fig: @kill --> |\n\n"
        "<!-- fig kill = r.json results.ermrun/SIGKILL.median -->\n"
        "5.7x<!-- fig: @ratio -->\n"
    )
    found = problems(tmp_path, doc, (("doc.md", None),))
    assert len(found) == 1 and "no '<!-- fig ratio = ... -->'" in found[0], found
    assert problems(tmp_path, doc.replace("8.33", "8.6").replace("5.7x<!-- fig: @ratio -->\n", "")) == [
        "doc.md:1: 8.6 s (r.json results.ermrun/SIGKILL.median): the file says 8.3 s"
    ]


def test_update_rewrites_a_run_s_date_and_commit_from_its_file(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    (results / "r.json").write_text(
        json.dumps(dict(RESULT, date="2026-12-05T10:00:00Z", commit="abcdef0123"))
    )
    doc = "run 2026-12-01, 79126fa<!-- run: r.json -->, "
    doc += "8.33 s<!-- fig: r.json results.ermrun/SIGKILL.median -->\n"
    (tmp_path / "doc.md").write_text(doc)
    assert update(tmp_path, results, ("doc.md",)) == 1
    assert (tmp_path / "doc.md").read_text() == doc.replace("2026-12-01, 79126fa", "2026-12-05, abcdef0")
    assert check(tmp_path, results, ("doc.md",), ()) == []
