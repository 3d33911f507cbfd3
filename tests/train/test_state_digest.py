"""The exact state digest: the same however a table is cut into pieces, and changed by what a sum of the
values cannot see (rows swapped within a table or between two tables of one shape, a value moved)."""

from __future__ import annotations

import torch

from elastic_rm.train.state_digest import digest_hex, piece_digest


def whole(tables: dict[str, torch.Tensor]) -> int:
    return int(sum(piece_digest(name, [0, 0], t) for name, t in tables.items()))


def test_any_cut_of_the_tables_gives_the_same_digest():
    t = torch.randn(100, 16)
    rows = piece_digest("t0", [0, 0], t[:37]) + piece_digest("t0", [37, 0], t[37:])  # row-wise shards
    cols = piece_digest("t0", [0, 0], t[:, :4]) + piece_digest("t0", [0, 4], t[:, 4:])  # column-wise
    grid = sum(piece_digest("t0", [r, c], t[r : r + 50, c : c + 8]) for r in (0, 50) for c in (0, 8))
    assert int(rows) == int(cols) == int(grid) == whole({"t0": t})


def test_swapped_rows_and_tables_change_the_digest_where_a_sum_does_not():
    a, b = torch.randn(50, 8), torch.randn(50, 8)
    base = whole({"t0": a, "t1": b})
    swapped = a.clone()
    swapped[[3, 7]] = swapped[[7, 3]]
    assert swapped.sum() == a.sum() and whole({"t0": swapped, "t1": b}) != base  # within a table
    assert whole({"t0": b, "t1": a}) != base  # between two tables of one shape
    moved = a.clone()
    moved[3, 0], moved[3, 1] = a[3, 1], a[3, 0]  # two values of one row
    assert whole({"t0": moved, "t1": b}) != base
    flipped = a.clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # the last bit of one value
    assert whole({"t0": flipped, "t1": b}) != base


def test_1d_and_0d_state_and_the_hex_form():
    m = torch.rand(40)  # a row-wise optimizer state
    assert int(piece_digest("m", [0], m)) == int(
        piece_digest("m", [0], m[:10]) + piece_digest("m", [10], m[10:])
    )
    assert int(piece_digest("step", [], torch.tensor(5.0))) != int(
        piece_digest("step", [], torch.tensor(6.0))
    )
    sums = torch.tensor([1, -2, 3], dtype=torch.int64)
    assert digest_hex(sums) == digest_hex(sums.clone()) != digest_hex(torch.tensor([1, -2, 4]))
    assert len(digest_hex(sums)) == 12
