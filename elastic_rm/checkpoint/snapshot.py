"""What a checkpoint holds (model + fused optimizer state + dense optimizer state) and a fast
in-memory snapshot of it, so the step loop pauses only for a memcpy while the write happens later."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor
from torchrec.distributed.model_parallel import DistributedModelParallel


def app_state(dmp: DistributedModelParallel, dense_optimizer: torch.optim.Optimizer | None = None) -> dict:
    """The DCP state dict: tensors are live views of the model and optimizer state.

    The fused optimizer's param_groups are left out (TorchRec's default, kept on purpose: they differ
    per rank, each listing only its own tables, so a resharded load would bind one rank's groups to
    another). Hyperparameters come from the training script. A rank with no fused shard gets no
    "optim" key at all (an empty dict would be a DCP leaf missing from the checkpoint).
    """
    state: dict[str, Any] = {"model": dmp.state_dict()}
    fused = dmp.fused_optimizer.state_dict()["state"]
    if fused:
        state["optim"] = fused
    if dense_optimizer is not None:  # the model's state dict once per save: it walks every module
        state["dense_optim"] = dense_optimizer_state(dmp, dense_optimizer, state["model"])
    return state


def _param_names(dmp: DistributedModelParallel, model_state: dict[str, Any]) -> dict[int, str]:
    """Parameter -> world-independent name: the model's state-dict key when the parameter is a
    replicated tensor there (data-parallel tables, dense layers), else its DMP parameter name."""
    by_ptr = {
        (t.data_ptr(), tuple(t.shape)): k
        for k, t in model_state.items()
        if isinstance(t, torch.Tensor) and not isinstance(t, ShardedTensor)
    }
    return {id(p): by_ptr.get((p.data_ptr(), tuple(p.shape)), n) for n, p in dmp.named_parameters()}


def dense_optimizer_state(
    dmp: DistributedModelParallel, opt: torch.optim.Optimizer, model_state: dict[str, Any] | None = None
) -> dict:
    """The dense optimizer's tensor state keyed by parameter name (torch keys it by position, which
    is not stable across plans). Lazily created state (e.g. Adam) is created first, see below.
    `model_state`: dmp.state_dict(), when the caller has it already."""
    names = _param_names(dmp, dmp.state_dict() if model_state is None else model_state)
    _ensure_state(opt)
    return {
        names[id(p)]: {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}
        for group in opt.param_groups
        for p in group["params"]
        if p in opt.state
    }


@torch.no_grad()
def _ensure_state(opt: torch.optim.Optimizer) -> None:
    """Create missing optimizer state with one zero-gradient step, restoring the parameters after it,
    so that a restore has tensors to load into."""
    params = [p for g in opt.param_groups for p in g["params"] if p not in opt.state or not opt.state[p]]
    if not params:
        return
    saved = [(p, p.detach().clone(), p.grad) for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p, value, grad in saved:
        p.copy_(value)
        p.grad = grad


def load_app_state(
    dmp: DistributedModelParallel,
    state: dict,
    dense_optimizer: torch.optim.Optimizer | None = None,
) -> None:
    """Push a state dict filled by dcp.load back into the model and optimizers."""
    dmp.load_state_dict(state["model"])
    if "optim" in state:
        dmp.fused_optimizer.load_state_dict({"state": state["optim"]})
    # dense optimizer state was loaded in place (its tensors are the optimizer's own)


class Snapshotter:
    """Copies a state dict's local tensors into buffers it keeps between saves (no page faults after
    the first save), wrapping them again as ShardedTensors with the original global metadata."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}
        self.bytes_copied = 0

    def _buffer(self, key: tuple[str, int], src: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu")
            self._buffers[key] = buf
        buf.copy_(src.detach())
        self.bytes_copied += buf.numel() * buf.element_size()
        return buf

    @torch.no_grad()
    def snapshot(self, state: Any, path: str = "") -> Any:
        if isinstance(state, dict):
            return {k: self.snapshot(v, f"{path}.{k}") for k, v in state.items()}
        if isinstance(state, list):
            return [self.snapshot(v, f"{path}.{i}") for i, v in enumerate(state)]
        if isinstance(state, ShardedTensor):
            shards = [
                Shard(self._buffer((path, i), s.tensor), s.metadata)
                for i, s in enumerate(state.local_shards())
            ]
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, state.metadata(), process_group=state._process_group
            )
        if isinstance(state, DTensor):
            raise TypeError(
                f"{path}: DTensor state is not supported by the flash checkpoint; build the DMP with "
                "ShardingEnv(output_dtensor=False) (the default of elastic_rm.train.wrap_model)"
            )
        if isinstance(state, torch.Tensor):
            return self._buffer((path, 0), state)
        return copy.deepcopy(state)

    def clear(self) -> None:
        self._buffers.clear()


def local_pieces(value: Any) -> list[tuple[list[int], torch.Tensor]]:
    """(global offsets, local tensor) of every local piece of a ShardedTensor or plain tensor."""
    if isinstance(value, ShardedTensor):
        return [(list(s.metadata.shard_offsets), s.tensor) for s in value.local_shards()]
    return [([0] * value.dim(), value)]


def state_bytes(state: Any) -> int:
    """Bytes of local tensor data in a state dict."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, list):
        return sum(state_bytes(v) for v in state)
    if isinstance(state, ShardedTensor | torch.Tensor):
        return sum(t.numel() * t.element_size() for _, t in local_pieces(state))
    return 0
