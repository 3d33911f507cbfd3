"""The emulated workload's speed-up curve (examples/emulated/train.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tests.conftest import REPO

_spec = importlib.util.spec_from_file_location(
    "emulated_train", Path(REPO) / "examples" / "emulated" / "train.py"
)
emulated = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(emulated)


def test_the_curve_is_linear_between_its_points_and_flat_past_the_last():
    curve = emulated.parse_curve("1:1,2:1.9,4:3.5")
    assert emulated.speedup(curve, 1) == 1.0
    assert emulated.speedup(curve, 3) == pytest.approx(2.7)
    assert emulated.speedup(curve, 16) == 3.5


@pytest.mark.parametrize("text", ["1:1,1:2", "2", "1:0", "a:1"])
def test_a_malformed_curve_says_how_to_write_one(text):
    with pytest.raises(ValueError, match="--curve"):
        emulated.parse_curve(text)
