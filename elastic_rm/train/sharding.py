"""Sharding plans for the world at hand, constrained so that a checkpoint reshards bit-exactly.

TorchRec's planner picks placements; the rules below fix, independently of the world size, what
would otherwise change the *layout of optimizer state* between worlds:

- a data-parallel table stays data-parallel at every world size, a sharded one stays sharded;
- a column-wise table keeps the same column-shard width (hence count) at every world size, and only
  column-wise tables have more than one column shard (row-wise Adagrad keeps one state row per column
  shard, so changing the count would change the state's shape);
- column-shard widths are multiples of 4 that divide the dimension (TorchRec silently ignores others).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ModuleSharder, ShardingEnv, ShardingPlan, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from ..checkpoint.plan_record import plan_digest, plan_summary

TW, RW, CW, DP = (
    ShardingType.TABLE_WISE.value,
    ShardingType.ROW_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.DATA_PARALLEL.value,
)
SHORT_NAMES = {"tw": TW, "rw": RW, "cw": CW, "dp": DP}


class ElasticPlanError(ValueError):
    """A plan or a rule would break bit-exact resharding across world sizes."""


@dataclass(frozen=True)
class WorldTopology:
    """The world a plan is made for. `memory_bytes_per_rank` is the planner's per-rank storage cap
    (DDR on CPU, HBM on CUDA); None keeps TorchRec's default."""

    world_size: int
    local_world_size: int
    memory_bytes_per_rank: int | None = None
    device: str = "cpu"

    @classmethod
    def from_env(cls, memory_bytes_per_rank: int | None = None, device: str | None = None) -> WorldTopology:
        """Read WORLD_SIZE / LOCAL_WORLD_SIZE as torchrun (and ermrun) set them."""
        world = int(os.environ.get("WORLD_SIZE", dist.get_world_size() if dist.is_initialized() else 1))
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(world, local, memory_bytes_per_rank, dev)

    def to_torchrec(self) -> Topology:
        """TorchRec's Topology, made by its TopologyFactory (a Topology built directly warns, at every
        round's planning, that the job will fail)."""
        from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig

        cap: dict[str, int] = {}
        if self.memory_bytes_per_rank is not None:
            cap["hbm_cap_bytes" if self.device == "cuda" else "ddr_cap_bytes"] = self.memory_bytes_per_rank
        trainer = TrainerConfig(world_size=self.world_size, local_world_size=self.local_world_size, **cap)
        return TopologyFactory.create_topology(
            trainer, kernel_config=KernelConfig(compute_device=self.device)
        )


@dataclass(frozen=True)
class ElasticRules:
    """World-independent sharding families per table.

    data_parallel: tables replicated on every rank (dense kernel, optimized by the dense optimizer).
    column_wise: table -> column-shard width (multiple of 4 dividing the dim); always column-wise.
    pinned: table -> the sharding types the planner may choose for it at this world (e.g. to force a
        re-layout in tests); must stay inside the table's family.
    sharded_types: types allowed for all other tables (one column shard each).
    """

    data_parallel: frozenset[str] = frozenset()
    column_wise: Mapping[str, int] = field(default_factory=dict)
    pinned: Mapping[str, Sequence[str]] = field(default_factory=dict)
    sharded_types: tuple[str, ...] = (TW, RW)

    def family(self, table: str) -> str:
        if table in self.data_parallel:
            return "data_parallel"
        return "column_wise" if table in self.column_wise else "sharded"

    def allowed_types(self, table: str) -> list[str]:
        fam = self.family(table)
        base = {"data_parallel": [DP], "column_wise": [CW], "sharded": list(self.sharded_types)}[fam]
        if table not in self.pinned:
            return base
        pinned = [SHORT_NAMES.get(t, t) for t in self.pinned[table]]
        bad = [t for t in pinned if t not in base]
        if bad:
            raise ElasticPlanError(
                f"table {table!r} is {fam} at every world size; pinned types {bad} would change that "
                f"(allowed: {base}). Change ElasticRules.data_parallel/column_wise instead."
            )
        return pinned

    def validate(self, tables: Sequence[EmbeddingBagConfig]) -> None:
        names = {t.name for t in tables}
        unknown = (set(self.data_parallel) | set(self.column_wise) | set(self.pinned)) - names
        if unknown:
            raise ElasticPlanError(f"rules name unknown tables {sorted(unknown)}; tables are {sorted(names)}")
        both = set(self.data_parallel) & set(self.column_wise)
        if both:
            raise ElasticPlanError(f"tables {sorted(both)} are both data-parallel and column-wise")
        for t in tables:
            width = self.column_wise.get(t.name)
            if width is not None and (width % 4 or t.embedding_dim % width):
                raise ElasticPlanError(
                    f"column-wise table {t.name!r}: shard width {width} must be a multiple of 4 that "
                    f"divides the embedding dim {t.embedding_dim}"
                )
        for t in self.sharded_types:
            if t not in (TW, RW):
                raise ElasticPlanError(f"sharded_types may hold only {TW!r} and {RW!r}, not {t!r}")

    def constraints(self, tables: Sequence[EmbeddingBagConfig]) -> dict[str, ParameterConstraints]:
        self.validate(tables)
        out: dict[str, ParameterConstraints] = {}
        for t in tables:
            types = self.allowed_types(t.name)
            kernel = EmbeddingComputeKernel.DENSE if types == [DP] else EmbeddingComputeKernel.FUSED
            out[t.name] = ParameterConstraints(
                sharding_types=types,
                compute_kernels=[kernel.value],
                min_partition=self.column_wise.get(t.name),
            )
        return out


class ElasticEBCSharder(EmbeddingBagCollectionSharder):
    """TorchRec's EBC sharder, also offering row-wise on CPU: its CPU list omits row-wise although the
    gloo path runs it (and reshards it bit-exactly: tests/train/test_train_reshard.py)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if RW not in types:
            types.append(RW)
        return types


def elastic_sharders() -> list[ModuleSharder[nn.Module]]:
    """Default sharders with the EBC sharder replaced by ElasticEBCSharder."""
    rest = [s for s in get_default_sharders() if type(s) is not EmbeddingBagCollectionSharder]
    return [ElasticEBCSharder(), *rest]  # type: ignore[list-item]


def embedding_tables(model: nn.Module) -> list[EmbeddingBagConfig]:
    """All EmbeddingBagConfigs of the model's EmbeddingBagCollections (meta-device models work)."""
    tables = [
        cfg
        for m in model.modules()
        if isinstance(m, EmbeddingBagCollection)
        for cfg in m.embedding_bag_configs()
    ]
    names = [t.name for t in tables]
    if len(names) != len(set(names)):
        raise ElasticPlanError(f"table names must be unique across the model: {names}")
    return tables


def plan_sharding(
    model: nn.Module,
    topology: WorldTopology,
    rules: ElasticRules | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
    check_same_on_all_ranks: bool = True,
    proposer: Any = None,
) -> ShardingPlan:
    """TorchRec's planner under the elastic rules; every rank computes the plan (it is deterministic)
    and, when a process group is up, the ranks check they agree (a digest all-gather).

    ``proposer``: TorchRec proposer(s) for the planner (None: its defaults, which try several and take
    0.3-0.5 s for a small model). A script that re-plans at every round in place can pass one, e.g.
    ``GreedyProposer()``, when it gives the same plan (docs/train.md)."""
    rules = rules or ElasticRules()
    tables = embedding_tables(model)
    planner = EmbeddingShardingPlanner(
        topology=topology.to_torchrec(), constraints=rules.constraints(tables), proposer=proposer
    )
    try:
        plan = planner.plan(model, sharders or elastic_sharders())
    except Exception as e:  # the planner's own errors do not say which knob to turn
        raise ElasticPlanError(
            f"TorchRec's planner found no plan for world {topology.world_size} under the elastic rules "
            f"(memory per rank {topology.memory_bytes_per_rank}): {e}. Give more memory per rank, more "
            "ranks, or allow row-wise sharding for the largest tables."
        ) from e
    check_plan(plan, tables, rules)
    if check_same_on_all_ranks and dist.is_initialized():
        check_plan_agreement(plan)
    return plan


def check_plan(plan: ShardingPlan, tables: Sequence[EmbeddingBagConfig], rules: ElasticRules) -> None:
    """Fail loudly if the planner produced something the rules forbid (e.g. a new TorchRec default)."""
    dims = {t.name: t.embedding_dim for t in tables}
    for tables_plan in plan_summary(plan).values():
        for name, p in tables_plan.items():
            fam = rules.family(name)
            if (p["type"] == DP) != (fam == "data_parallel"):
                raise ElasticPlanError(f"table {name!r}: planner chose {p['type']} but the table is {fam}")
            col_offsets = {s[1] for s in p["shards"]}
            want = dims[name] // rules.column_wise[name] if fam == "column_wise" else 1
            if p["type"] != DP and len(col_offsets) != want:
                raise ElasticPlanError(
                    f"table {name!r}: {len(col_offsets)} column shards, the rules need {want} at every world"
                )


def check_plan_agreement(plan: ShardingPlan, pg: dist.ProcessGroup | None = None) -> None:
    digest = torch.tensor(list(bytes.fromhex(plan_digest(plan))[:16]), dtype=torch.uint8)
    gathered = [torch.empty_like(digest) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(gathered, digest, group=pg)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise ElasticPlanError(
            "ranks computed different sharding plans; give every rank the same model, rules and topology"
        )


def wrap_model(
    model: nn.Module,
    plan: ShardingPlan,
    device: torch.device | None = None,
    pg: dist.ProcessGroup | None = None,
    sharders: list[ModuleSharder[nn.Module]] | None = None,
) -> DistributedModelParallel:
    """DistributedModelParallel over the plan: gloo on CPU; on CUDA the process group must be NCCL and
    `device` this rank's GPU (default cuda:LOCAL_RANK). The CUDA path is not exercised by the tests."""
    if not dist.is_initialized():
        raise RuntimeError("init the process group first (dist.init_process_group('gloo' or 'nccl'))")
    if device is None:
        if torch.cuda.is_available() and dist.get_backend(pg) == "nccl":
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
    env = ShardingEnv.from_process_group(pg or dist.group.WORLD)  # type: ignore[arg-type]
    return DistributedModelParallel(
        module=model, env=env, device=device, plan=plan, sharders=sharders or elastic_sharders()
    )


def dense_parameters(dmp: DistributedModelParallel) -> list[tuple[str, nn.Parameter]]:
    """Parameters the training script's own (dense) optimizer must update: everything but the fused
    embedding shards and the empty placeholders DMP leaves for tables held by other ranks. These are
    the data-parallel tables and the dense layers; build the dense optimizer over exactly these."""
    fused = set(dmp.fused_optimizer.params.keys())
    return [(n, p) for n, p in dmp.named_parameters() if n not in fused and p.numel() > 0 and p.requires_grad]
