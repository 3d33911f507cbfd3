"""The example scripts refuse bad flags with a usage error."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

DLRM = Path(__file__).resolve().parents[2] / "examples" / "dlrm" / "train.py"


def dlrm_example():
    spec = importlib.util.spec_from_file_location("dlrm_example", DLRM)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("flag", ["--checkpoint-every", "--range-steps"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_dlrm_example_refuses_a_zero_interval_before_training(
    flag: str, value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--checkpoint-every 0` trained a step, then died with ZeroDivisionError (step % 0); `--range-steps 0`
    died in the ledger with a traceback. Both are a usage error now, before anything is built."""
    example = dlrm_example()
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "3", flag, value])
    with pytest.raises(SystemExit) as exc:
        example.parse_args()
    assert exc.value.code == 2
    assert f"{flag} must be >= 1, got {value}" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["train.py", "--steps", "3", flag, "1"])
    assert example.parse_args().steps == 3
