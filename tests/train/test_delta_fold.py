"""Compaction of differential chains on real gloo worlds: a save whose delta would take the chain past
its bound folds the chain so far into its base in place (the step pauses for the touched rows only) and
writes its delta on top; the folded base restores bit for bit, the durable copy gets the same chain, the
peer folds its replica from the deltas it holds, and node memory stays within (1 + compact_ratio) times
the base."""

from __future__ import annotations

import http.client
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from erm_harness import assemble, assert_bit_exact, run_world

from elastic_rm.checkpoint.local_servers import NodeServer, node_servers, peer_lists

TABLES = [  # a step touches under 1% of the rows
    {"name": "t0", "rows": 3000, "dim": 16},
    {"name": "t1", "rows": 2570, "dim": 16},
    {"name": "t2", "rows": 2000, "dim": 32},  # column-wise
    {"name": "t3", "rows": 40, "dim": 16},  # data-parallel: dense
]


def spec(phases: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "tables": TABLES,
        "optim": "rowwise_adagrad",
        "data_parallel": ["t3"],
        "column_wise": {"t2": 8},
        "phases": phases,
    }


def phase(world: int, actions: list[dict[str, Any]], **flash: Any) -> dict[str, Any]:
    pinned = {"t0": ["tw"], "t1": ["rw"]} if world % 2 == 0 else {"t0": ["rw"], "t1": ["tw"]}
    return {
        "world": world,
        "nodes": [f"n{r}" for r in range(world)],
        "pinned": pinned,
        "flash": flash,
        "actions": actions,
    }


def trained_saves(steps: list[int], dump: bool = False) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"do": "init"}]
    for step in steps:
        out += [{"do": "train", "seeds": [step]}, {"do": "save", "step": step, "block": True}]
        if dump:
            out.append({"do": "dump", "name": f"s{step}"})
    return out


def manifest(root: Path, step: int) -> dict[str, Any]:
    return json.loads((root / f"step-{step:08d}" / "manifest.json").read_bytes())


# 10 s; CI keeps the other folds' bit-for-bit restores in this file and tests/train/test_fold_in_place.py
@pytest.mark.slow
def test_a_fold_pauses_like_a_delta_and_its_base_restores_bit_for_bit(tmp_path: Path) -> None:
    """compact_ratio tiny: every save after the first delta passes the bound (full, delta, fold, fold,
    ...): each folds the chain before it into a base in place and writes its delta on top. The durable
    copy holds the same chain (the folded bases as full steps); it restores the newest step bit for
    bit."""
    steps = [1, 2, 3, 4, 5, 6]
    shm, durable = tmp_path / "shm", tmp_path / "durable"
    diff = {
        "memory_root": str(shm),
        "durable_dir": str(durable),
        "differential": True,
        "compact_ratio": 1e-9,
        "keep_memory": 1,
        "keep_durable": 10,
    }
    drop_memory = [{"do": "rm_dir", "path": str(shm)}]
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    phases = [
        phase(2, trained_saves(steps, dump=True), **diff),
        phase(2, [*drop_memory, *restore], **diff),
    ]
    results = run_world(2, spec(phases), tmp_path)
    saves = results[0][0]["saves"]
    assert [s["kind"] for s in saves] == ["full", "delta", "fold", "fold", "fold", "fold"], saves
    # the CPU the saves spent on this rank, by part, only grows; each part that ran has counted some
    cpu = [s["cpu_seconds"] for s in saves]
    assert all(a[k] <= b[k] for a, b in zip(cpu[:-1], cpu[1:], strict=True) for k in a), cpu
    assert all(cpu[-1][k] > 0 for k in ("pause", "fold", "memory", "roll", "persist")), cpu[-1]
    full_bytes = saves[0]["bytes"]
    for s in saves[1:]:  # the pause of a fold copies the touched rows, like a delta
        assert s["bytes"] < full_bytes / 2, (s, full_bytes)
    folded = manifest(durable, 5)
    assert folded.get("kind", "full") == "full" and folded["folded"]["base"] == 4 and "layout" in folded
    # the durable copy holds the same chains: the folded bases as full steps, each delta on its base
    assert [manifest(durable, s).get("base") for s in steps] == [None, None, None, None, None, 5]
    restored = results[0][1]["restores"][0]
    assert restored["step"] == 6 and restored["skipped"] == [] and restored["sources"] == ["durable"]
    assert assert_bit_exact(assemble(tmp_path, "s6"), assemble(tmp_path, "restored"), "durable") > 10_000


def held_steps(durable: Path, steps: list[int]) -> int:
    """The most steps one chain of the durable copy held at once (its base and its deltas): a node's
    memory holds no more of them than that."""
    held = 1
    for step in steps:
        base = manifest(durable, step).get("base")
        if base is not None:
            held = max(
                held, 1 + sum(1 for s in steps if s <= step and manifest(durable, s).get("base") == base)
            )
    return held


def own_bytes(m: dict[str, Any], node: str | None = None) -> int:
    """The bytes of a step's files that `node` holds (its own and the shared ones, node "*"); every
    node's without one."""
    return sum(e["size"] for e in m["files"].values() if node is None or e["node"] in (node, "*"))


def bounded_flash(tmp_path: Path, ratio: float, keep: int = 1, **extra: Any) -> dict[str, Any]:
    """A differential checkpoint under `ratio`, whose durable copy keeps every step's manifest: the
    memory bounds are read from those sizes."""
    return {
        "memory_root": str(tmp_path / "shm"),
        "durable_dir": str(tmp_path / "durable"),
        "differential": True,
        "compact_ratio": ratio,
        "keep_memory": keep,
        "keep_durable": 100,
        **extra,
    }


def full_manifests(durable: Path, steps: list[int]) -> list[dict[str, Any]]:
    """The manifests of the bases (full steps) among `steps`."""
    return [m for m in (manifest(durable, s) for s in steps) if m.get("kind", "full") == "full"]


def largest_manifest(durable: Path, steps: list[int]) -> int:
    return max((durable / f"step-{step:08d}" / "manifest.json").stat().st_size for step in steps)


def largest_header(durable: Path, steps: list[int], payload: Any, node: str | None = None) -> int:
    """The most bytes a delta's files (`node`'s, or all) held beyond the rows it copied (`payload(step)`):
    its header and padding, which a delta adds past the bound before the next save folds."""
    deltas = [step for step in steps if manifest(durable, step).get("kind") == "delta"]
    return max([0, *(own_bytes(manifest(durable, step), node) - payload(step) for step in deltas)])


def test_node_memory_stays_within_the_bound_at_every_save(tmp_path: Path) -> None:
    """A deterministic sequence of saves (block=True, one node, several folds): the node directory's
    bytes at their largest (sampled right before each fold, when the chain is at its largest, and
    before each publish of a base) never pass (1 + compact_ratio) times the base, plus one delta
    file's header (a delta's rows are counted against the bound before it is written) and the
    manifests of the steps held: a fold holds no second base."""
    ratio, durable = 0.05, tmp_path / "durable"
    flash = bounded_flash(tmp_path, ratio, keep=2)
    steps = list(range(1, 21))
    results = run_world(1, spec([phase(1, trained_saves(steps), **flash)]), tmp_path)
    saves = results[0][0]["saves"]
    kinds = [s["kind"] for s in saves]
    assert kinds.count("fold") >= 2 and kinds[0] == "full" and "full" not in kinds[1:], kinds
    manifests = largest_manifest(durable, steps)
    headers = largest_header(durable, steps, lambda step: saves[step - 1]["bytes"])
    base = max(own_bytes(m) for m in full_manifests(durable, steps))
    bound = (1 + ratio) * base + headers + held_steps(durable, steps) * manifests
    peaks = [s["memory_peak_bytes"] for s in saves]
    assert peaks[-1] <= bound, (peaks, base, headers, manifests)
    assert peaks[-1] > base + ratio * base / 2, "the chain never grew near its bound: the test shows nothing"


@pytest.mark.slow  # 9 s; CI keeps the bound at every save (above)
def test_each_node_stays_within_the_bound_of_its_own_base_with_skewed_tables(tmp_path: Path) -> None:
    """Skewed tables (the normal case with power-law ids): one node holds a small hot table, touched
    at every step, the other a large cold one. A bound on the whole chain would let the hot node hold
    several times its own base; each node's memory stays within (1 + compact_ratio) times its own
    files of the base, plus one delta's header and the manifests of the steps held."""
    ratio, durable = 0.5, tmp_path / "durable"
    flash = bounded_flash(tmp_path, ratio)
    steps = list(range(1, 17))
    tables = [{"name": "hot", "rows": 600, "dim": 16}, {"name": "cold", "rows": 60000, "dim": 16}]
    world = {
        "world": 2,
        "nodes": ["n0", "n1"],
        "pinned": {"hot": ["tw"], "cold": ["tw"]},
        "flash": flash,
        "actions": trained_saves(steps),
    }
    results = run_world(2, {"tables": tables, "optim": "rowwise_adagrad", "phases": [world]}, tmp_path)
    saves = [results[r][0]["saves"] for r in range(2)]
    assert "fold" in [x["kind"] for x in saves[0]], saves[0]
    held, manifests = held_steps(durable, steps), largest_manifest(durable, steps)
    fulls = full_manifests(durable, steps)
    for r, node in enumerate(["n0", "n1"]):
        base = max(own_bytes(m, node) for m in fulls)
        headers = largest_header(durable, steps, lambda step, r=r: saves[r][step - 1]["bytes"], node)
        peak = saves[r][-1]["memory_peak_bytes"]
        assert peak <= (1 + ratio) * base + headers + held * manifests, (node, peak, base, headers, held)
    bases = [own_bytes(manifest(durable, 1), n) for n in ("n0", "n1")]
    assert max(bases) > 10 * min(bases), ("the tables are not skewed: the test shows nothing", bases)


def server_peak(server: NodeServer) -> int:
    """The node directory's bytes at their largest, as its checkpoint server sampled them."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", "/v1/steps", headers={"Authorization": f"Bearer {server.token}"})
        return int(json.loads(conn.getresponse().read())["peak_bytes"])
    finally:
        conn.close()


# 11 s; CI keeps the bound at every save and per node with skewed tables, and the peer's folded chain
@pytest.mark.slow
def test_two_nodes_with_replicas_stay_within_the_bound_over_several_folds(tmp_path: Path) -> None:
    """Two nodes, each holding its own chain and its peer's replica, over several folds: each node
    directory's bytes at their largest, as its checkpointer and its checkpoint server sampled them,
    stay within (1 + compact_ratio) times the two bases it holds, plus delta headers and manifests."""
    ratio, shm, durable = 0.05, tmp_path / "shm", tmp_path / "durable"
    flash = bounded_flash(tmp_path, ratio, replicate=True)
    nodes = ["n0", "n1"]
    steps = list(range(1, 21))
    with node_servers(shm, nodes) as s:
        phases = [{**phase(2, trained_saves(steps), **flash), "peers": peer_lists(s, nodes)}]
        results = run_world(2, spec(phases), tmp_path)
        server_peaks = {n: server_peak(s[n]) for n in nodes}
    saves = [results[r][0]["saves"] for r in range(2)]
    kinds = [x["kind"] for x in saves[0]]
    assert kinds.count("fold") >= 2 and "full" not in kinds[1:], kinds
    base_bytes = own_bytes(manifest(durable, 1))  # every base of the run has the same files' sizes
    manifests = largest_manifest(durable, steps)
    headers = largest_header(durable, steps, lambda step: sum(saves[r][step - 1]["bytes"] for r in range(2)))
    # a node holds its own files of the base and its peer's, that is one whole base's bytes; each
    # chain (its own, the peer's replica) may pass its bound by one delta's header
    bound = (1 + ratio) * base_bytes + 2 * headers + 2 * held_steps(durable, steps) * manifests
    for r, node in enumerate(nodes):
        peak = max(saves[r][-1]["memory_peak_bytes"], server_peaks[node])
        assert peak <= bound, (node, peak, bound, base_bytes, headers, manifests)
        assert peak > base_bytes + ratio * base_bytes / 2, "the chains never grew near their bound"


def test_the_peer_holds_the_folded_chain_and_a_new_node_restores_from_it(tmp_path: Path) -> None:
    """Two nodes, each with its checkpoint server process, replicas pushed to the ring peer: at a fold
    the peer folds its replica in place from the deltas it holds (only the deltas cross the network),
    and the delta after it goes on top. Then n1's memory is lost: at world 2 again, n1's rank reads its
    shards of the chain (the base's blocks and the parts of the delta files it applies) from n0's
    server, and the state is restored bit for bit."""
    shm = tmp_path / "shm"
    flash = {"memory_root": str(shm), "differential": True, "compact_ratio": 1e-9, "replicate": True}
    nodes = ["n0", "n1"]
    lose = [{"do": "rm_dir", "path": str(shm / "n1")}]
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    with node_servers(shm, nodes) as s:
        phases = [
            {**phase(2, trained_saves([1, 2, 3, 4], dump=True), **flash), "peers": peer_lists(s, nodes)},
            {**phase(2, [*lose, *restore], **flash), "peers": peer_lists(s, nodes)},
        ]
        results = run_world(2, spec(phases), tmp_path)
    saves = results[1][0]["saves"]  # n1's leader
    assert [s["kind"] for s in saves] == ["full", "delta", "fold", "fold"]
    held = shm / "n0" / "replicas" / "n1"
    assert sorted(p.name for p in held.iterdir()) == ["step-00000003", "step-00000004"]
    assert manifest(held, 3).get("kind", "full") == "full" and manifest(held, 4)["base"] == 3
    for step in (3, 4):  # a manifest is the same on every node
        assert manifest(held, step)["manifest_sha256"] == manifest(shm / "n0", step)["manifest_sha256"]
    # after the base, only delta files crossed: each push at most one delta's own files
    base_bytes = saves[0]["bytes_pushed"]
    pushed = [b["bytes_pushed"] - a["bytes_pushed"] for a, b in zip(saves, saves[1:], strict=False)]
    assert all(0 < n < base_bytes / 4 for n in pushed), (base_bytes, pushed)
    restored = [results[r][1]["restores"][0] for r in range(2)]
    assert all(r["step"] == 4 and r["skipped"] == [] for r in restored), restored
    assert "peer:n0" in restored[1]["sources"], restored[1]
    assert (
        assert_bit_exact(assemble(tmp_path, "s4"), assemble(tmp_path, "restored"), "from the peer") > 10_000
    )


@pytest.mark.slow  # 15 s; CI keeps tests/train/test_fold_in_place.py's split-fold cases
def test_a_node_lost_between_its_own_fold_and_its_peers_restores_from_the_same_fold(tmp_path: Path) -> None:
    """Three nodes with replicas: steps 1 (a base) and 2 (a delta) are committed and replicated
    everywhere; step 3 folds. n0 dies once every node folded its own memory, before its ring peer (n1)
    folded n0's replica: the survivors hold step 2 folded, and n0's files only in n1's replica, still
    the chain. Before the restore n1 folds that replica the same way, so world 2 restores step 2 bit
    for bit (without it no step was held alike: the fold had removed step 1 on the survivors)."""
    shm = tmp_path / "shm"
    flash = {"memory_root": str(shm), "differential": True, "compact_ratio": 1e-9, "replicate": True}
    nodes, survivors = ["n0", "n1", "n2"], ["n1", "n2"]
    with node_servers(shm, nodes) as s:
        actions = trained_saves([1, 2], dump=True) + [
            {"do": "exit_before_peer_fold", "node": "n0"},
            {"do": "train", "seeds": [3]},
            {"do": "save", "step": 3, "block": True},
        ]
        with pytest.raises(AssertionError, match=r"--- rank 0 \(rc 137\) ---"):
            run_world(
                3, spec([{**phase(3, actions, **flash), "peers": peer_lists(s, nodes)}]), tmp_path / "a"
            )
        s["n0"].proc.kill()  # n0 is lost: its agent (its checkpoint server) and its memory with it
        s["n0"].proc.wait(timeout=30)
        shutil.rmtree(shm / "n0")
        held = shm / "n1" / "replicas" / "n0"
        assert manifest(held, 2)["kind"] == "delta" and "folded" in manifest(shm / "n1", 2)
        restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
        b = {**phase(2, restore, **flash), "nodes": survivors, "peers": peer_lists(s, survivors)}
        shutil.copytree(tmp_path / "a" / "dump", tmp_path / "b" / "dump")
        results = run_world(2, spec([b]), tmp_path / "b")
    restored = [results[r][0]["restores"][0] for r in range(2)]
    assert all(r.get("step") == 2 and r["skipped"] == [] for r in restored), restored
    assert manifest(held, 2)["manifest_sha256"] == manifest(shm / "n1", 2)["manifest_sha256"]
    got = assemble(tmp_path / "b", "restored")
    assert assert_bit_exact(assemble(tmp_path / "b", "s2"), got, "split fold") > 10_000


@pytest.mark.slow  # 10 s; CI keeps test_fold_in_place.py's refused fold written in full
def test_buffers_that_do_not_hold_the_chain_make_the_fold_a_full_save(tmp_path: Path) -> None:
    """prepare() refills the snapshot buffers with the live state of no committed step: the next save
    past the bound cannot fold from them and is a full save (every rank agrees); the buffers follow the
    new chain again, so the one after can fold. Each restores bit for bit."""
    flash = {
        "memory_root": str(tmp_path / "shm"),
        "durable_dir": str(tmp_path / "durable"),  # a node reads only its own memory: n1's files
        "differential": True,
        "compact_ratio": 1e-9,
    }
    actions = trained_saves([1, 2])
    actions += [{"do": "prepare"}, *trained_saves([3, 4, 5], dump=True)[1:]]
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    results = run_world(2, spec([phase(2, actions, **flash), phase(2, restore, **flash)]), tmp_path)
    saves = results[0][0]["saves"]
    assert [s["kind"] for s in saves] == ["full", "delta", "full", "delta", "fold"]
    assert "prepare()" in saves[2]["reason"] and [s["reason"] for s in saves[3:]] == ["", ""], saves
    assert results[0][1]["restores"][0].get("step") == 5, results[0][1]["restores"]
    assert (
        assert_bit_exact(assemble(tmp_path, "s5"), assemble(tmp_path, "restored"), "after prepare") > 10_000
    )


@pytest.mark.slow  # 10 s; CI keeps the one-rank-per-node folds of this file
def test_a_node_of_two_ranks_folds_both_files_and_dense_state_where_the_base_holds_it(tmp_path: Path) -> None:
    """Two ranks on one node: its leader folds both ranks' files from both ranks' delta files. The base
    keeps the data-parallel table and its optimizer state in one rank's file, and that rank's deltas
    carry them (the base's layout names the writer); the folded chain restores bit for bit."""
    shm = tmp_path / "shm"
    flash = {"memory_root": str(shm), "differential": True, "compact_ratio": 1e-9, "keep_memory": 1}
    one_node = {"nodes": ["n0", "n0"]}
    restore = [{"do": "restore"}, {"do": "dump", "name": "restored"}]
    phases = [
        {**phase(2, trained_saves([1, 2, 3, 4, 5], dump=True), **flash), **one_node},
        {**phase(2, restore, **flash), **one_node},
    ]
    results = run_world(2, spec(phases), tmp_path)
    assert [s["kind"] for s in results[0][0]["saves"]] == ["full", "delta", "fold", "fold", "fold"]
    assert sorted(p.name for p in (shm / "n0").iterdir()) == ["step-00000004", "step-00000005"]
    layout = manifest(shm / "n0", 4)["layout"]
    dense = {f for f, items in layout.items() for item in items if ".t3." in item[0]}
    assert len(dense) == 1, layout  # one rank's file holds the data-parallel table
    restored = results[0][1]["restores"][0]
    assert restored["step"] == 5 and restored["skipped"] == [], restored
    assert assert_bit_exact(assemble(tmp_path, "s5"), assemble(tmp_path, "restored"), "one node") > 10_000


def test_an_old_chain_goes_once_a_chain_folded_soon_after_its_base_holds_keep_memory_steps(
    tmp_path: Path,
) -> None:
    """keep_memory=3 and a new base (the save after a restore) beside the old chain (steps 1, 2). Two
    large deltas make the new chain fold at its 2nd and 3rd saves after the base (steps 5, 6): the
    folded chain (5, 6) holds fewer than keep_memory steps when the base's prunes run out. Once it
    holds keep_memory steps (5, 6, 7) the old chain goes, and node memory is within (1 + compact_ratio)
    times the base again (without a prune after the fold it stayed for the new chain's whole life)."""
    ratio, shm, durable = 0.13, tmp_path / "shm", tmp_path / "durable"
    flash = bounded_flash(tmp_path, ratio, keep=3)
    seeds = {1: 1, 2: 1, 3: 1, 4: 16, 5: 16, 6: 1, 7: 1, 8: 1}  # step -> batches trained before it
    actions: list[dict[str, Any]] = [{"do": "init"}]
    first = 0
    for step, n in seeds.items():
        if step == 3:
            actions.append({"do": "restore"})  # the next save is a new base, beside the chain 1, 2
        actions += [
            {"do": "train", "seeds": list(range(first, first + n))},
            {"do": "save", "step": step, "block": True},
            {"do": "copy_dir", "path": str(shm / "n0"), "to": str(tmp_path / "held" / str(step))},
        ]
        first += n
    results = run_world(1, spec([phase(1, actions, **flash)]), tmp_path)
    saves = results[0][0]["saves"]
    kinds = [s["kind"] for s in saves]
    assert kinds == ["full", "delta", "full", "delta", "fold", "fold", "delta", "delta"], kinds
    assert results[0][0]["restores"][0]["step"] == 2
    held = {
        step: sorted(
            int(p.name.removeprefix("step-")) for p in (tmp_path / "held" / str(step)).glob("step-*")
        )
        for step in seeds
    }
    assert held[6] == [1, 2, 5, 6], held  # the newest 3 steps are 2, 5, 6: the old chain is kept
    assert held[7] == [5, 6, 7] and held[8] == [5, 6, 7, 8], held
    steps = list(seeds)
    base = max(own_bytes(m) for m in full_manifests(durable, steps))
    headers = largest_header(durable, steps, lambda step: saves[step - 1]["bytes"])
    bound = (1 + ratio) * base + headers + len(held[8]) * largest_manifest(durable, steps)
    now = sum(p.stat().st_size for p in (tmp_path / "held" / "8").rglob("*") if p.is_file())
    assert now <= bound, (now, bound, base)


@pytest.mark.slow  # 9 s; CI keeps test_fold_in_place.py's refused fold written in full (the same way out)
def test_a_fold_that_fails_on_one_rank_with_an_unexpected_error_is_a_full_save_on_every_rank(
    tmp_path: Path,
) -> None:
    """One rank's fold fails with an error no fold expects (a MemoryError as it computes its files'
    checksums): every rank still reaches the fold's gather and hears of it, and the save goes on in
    full everywhere, as for a refused fold; nothing is lost and the step restores bit for bit."""
    shm = tmp_path / "shm"
    actions = trained_saves([1, 2]) + [
        {"do": "fail_fold_entries", "rank": 1},
        {"do": "train", "seeds": [3]},
        {"do": "save", "step": 3, "block": True},
        {"do": "dump", "name": "s3"},
        {"do": "restore"},
        {"do": "dump", "name": "restored"},
    ]
    flash = {"memory_root": str(shm), "differential": True, "compact_ratio": 1e-9, "keep_memory": 10}
    with node_servers(shm, ["n0", "n1"]) as servers:  # each rank reads the other node's files from it
        one = {**phase(2, actions, **flash), "peers": peer_lists(servers, ["n0", "n1"])}
        results = run_world(2, spec([one]), tmp_path)
    assert [[s["kind"] for s in results[r][0]["saves"]] for r in (0, 1)] == [["full", "delta", "fold"]] * 2
    step3 = manifest(shm / "n0", 3)
    assert step3.get("kind", "full") == "full" and "folded" not in step3
    assert results[0][0]["restores"][0]["step"] == 3
    assert_bit_exact(assemble(tmp_path, "s3"), assemble(tmp_path, "restored"), "step 3 saved in full")
