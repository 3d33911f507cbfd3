"""FlashConfig refuses values out of range when it is made, naming the field: a NaN keep_memory passed
the old `< 1` check (every comparison with NaN is False), after which node memory was never pruned and
a NaN keep_durable pruned the durable copy's every step, the one just persisted included; a float keep
failed the first save in its background thread; persist_every=0 persisted every save; a timeout of
NaN, 0 or below failed or timed out the first wait()."""

from __future__ import annotations

import math

import pytest

from elastic_rm.checkpoint.flash import FlashConfig

BAD = [
    ("keep_memory", math.nan),
    ("keep_memory", 1.5),
    ("keep_memory", "2"),
    ("keep_memory", True),
    ("keep_durable", math.nan),
    ("keep_durable", None),
    ("persist_every", 0),
    ("persist_every", -3),
    ("persist_every", 2.0),
    ("compact_ratio", math.nan),
    ("compact_ratio", "1.0"),
    ("compact_ratio", -1),
    ("timeout_s", math.nan),
    ("timeout_s", 0),
    ("timeout_s", -5.0),
    ("timeout_s", math.inf),
    ("peer_timeout_s", math.nan),
    ("peer_timeout_s", -1),
    ("peer_timeout_s", "30"),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_a_value_out_of_range_is_refused_naming_its_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"FlashConfig\.{field} must be"):
        FlashConfig(run_id="r", node_id="n", peers=None, **{field: value})


def test_values_in_range_are_kept() -> None:
    import numpy as np

    cfg = FlashConfig(
        run_id="r",
        node_id="n",
        peers=None,
        keep_memory=np.int64(3),  # an integer of numpy's is an integer
        keep_durable=1,
        persist_every=5,
        compact_ratio=math.inf,  # never folds
        timeout_s=0.5,
        peer_timeout_s=np.float64(2.5),
    )
    assert (cfg.keep_memory, cfg.persist_every, cfg.peer_timeout_s) == (3, 5, 2.5)
    assert type(cfg.keep_memory) is int  # it goes into JSON and URLs
