"""One idea per module: no module of the library or the launcher grows past 400 lines."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 400


def test_no_module_is_over_the_limit():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines())
        for package in ("elastic_rm", "launcher")
        for p in (ROOT / package).rglob("*.py")
    }
    assert len(sizes) > 50  # the scan found the package
    assert {path: n for path, n in sizes.items() if n > LIMIT} == {}, "split these modules by idea"
