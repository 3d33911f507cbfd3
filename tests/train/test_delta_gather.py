"""A save's exchange of touched row ids between ranks (TouchedRows.take) on two real gloo processes: the
ids of every rank reach every rank whether they fit the first round's buffer or need the second (the
buffer's capacity comes from the previous take: a take much larger than the last one overflows it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from elastic_rm.checkpoint.delta_tracker import MAX_CAPACITY

REPO = Path(__file__).resolve().parents[2]
ROWS = 1_000_000
# ids each rank records, per take: rank 0 overflows the first take's buffer, rank 1 the second's; the
# fourth is larger than the capacity's bound, which the fifth's buffer keeps to
PLAN = [
    {"0": [0, 5000], "1": [59_990, 59_993]},
    {"0": [7, 9], "1": [10_000, 30_000]},
    {"0": [100, 103], "1": [200, 202]},
    {"0": [0, 600_000], "1": [5, 7]},
    {"0": [100, 103], "1": [200, 202]},
]


def rank_main(init: str, rank: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torchrec import KeyedJaggedTensor

    from elastic_rm.checkpoint.delta_tracker import TouchedRows
    from tests.train.test_delta_tracker import KEY, ShardedBags, TableConfig

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        bags = ShardedBags()
        bags._embedding_bag_configs = [TableConfig("t0", ROWS, ["f0"])]
        m = nn.Module()
        m.add_module("bags", bags)
        tracker = TouchedRows(m)
        taken = []
        for take in PLAN:
            lo, hi = take[str(rank)]
            ids = torch.arange(lo, hi)
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=["f0"], values=ids, lengths=torch.tensor([len(ids)])
            )
            m.bags.input_dist(None, kjt)
            m.bags.compute_and_output_dist(None, kjt)
            got = tracker.take()[KEY]
            taken.append(
                [int(got.numel()), int(got.min()), int(got.max()), bool(torch.all(got[1:] > got[:-1]))]
                + [tracker.capacity]
            )
        tracker.detach()
        Path(out).write_text(json.dumps(taken))
    finally:
        dist.destroy_process_group()


def test_every_rank_gets_every_ranks_ids_in_one_round_or_two(tmp_path: Path) -> None:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tests.train.test_delta_gather import rank_main; "
                "rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])",
                str(tmp_path / "pg"),
                str(r),
                str(tmp_path / f"out-{r}.json"),
            ],
            cwd=REPO,
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    expected = []
    for take in PLAN:
        ids = set(range(*take["0"])) | set(range(*take["1"]))
        longest = max(hi - lo for lo, hi in take.values())
        capacity = min(MAX_CAPACITY, max(1 << 12, 1 << (2 * longest).bit_length()))
        expected.append([len(ids), min(ids), max(ids), True, capacity])
    assert expected[3][4] == MAX_CAPACITY
    for r in range(2):
        assert json.loads((tmp_path / f"out-{r}.json").read_text()) == expected, r


def bytes_main(init: str, rank: int, out: str) -> None:
    import torch.distributed as dist

    from elastic_rm.checkpoint.collectives import INLINE_BYTES, all_gather_bytes

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    try:
        got = []
        for sizes in ([10, 20], [INLINE_BYTES + 1, 0], [0, 3 * INLINE_BYTES], [INLINE_BYTES, INLINE_BYTES]):
            data = bytes([65 + rank]) * sizes[rank]
            got.append([b.decode() for b in all_gather_bytes(data)])
        Path(out).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def test_all_gather_bytes_in_one_round_or_two(tmp_path: Path) -> None:
    from elastic_rm.checkpoint.collectives import INLINE_BYTES

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import sys; from tests.train.test_delta_gather import bytes_main; "
                "bytes_main(sys.argv[1], int(sys.argv[2]), sys.argv[3])",
                str(tmp_path / "pg"),
                str(r),
                str(tmp_path / f"out-{r}.json"),
            ],
            cwd=REPO,
        )
        for r in range(2)
    ]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    n = INLINE_BYTES
    expected = [["A" * a, "B" * b] for a, b in ([10, 20], [n + 1, 0], [0, 3 * n], [n, n])]
    for r in range(2):
        assert json.loads((tmp_path / f"out-{r}.json").read_text()) == expected, r
