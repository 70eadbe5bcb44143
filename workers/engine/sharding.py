"""FSDP2 for the trainer: parameters, gradients and optimizer state sharded over the ranks.

`trainer.sharding: fsdp` applies `torch.distributed.fsdp.fully_shard` to each transformer
block and then to the whole model (embeddings, final norm and head, tied or not, form the
root unit). Gradients are reduce-scattered as a sum, not a mean: the GRPO loss already
divides by the whole step's token count (`loss_normalizer`), exactly as the replicated
trainer sums its all-reduce.

Checkpoints stay in one format whatever the sharding: the full model state dict (the same
names as an unsharded model, so export and resume work across `trainer.sharding`), and the
optimizer state either index-keyed (`optimizer.state_dict()`) or name-keyed (written by a
sharded trainer); `optimizer_state_for` converts between the two. (torch's
`get_model_state_dict` is not used: it maps each state-dict key to a module attribute, and
torchtitan's fused QKV projection saves `wq`/`wk`/`wv` that are not attributes.)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor


def shard_model(model: nn.Module, *, mixed_precision: str) -> nn.Module:
    """Shard each block of `model.layers`, then the root; `mixed_precision: bf16` computes in bf16, reduces in fp32."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if mixed_precision == "bf16" else MixedPrecisionPolicy()
    blocks = list(model.layers.values()) if isinstance(model.layers, nn.ModuleDict) else list(model.layers)
    for block in blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    for unit in [*blocks, model]:  # each unit reduces its own gradients
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)  # a divide factor otherwise needs PREMUL_SUM, which gloo lacks
    return model


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def reshard(model: nn.Module) -> None:
    """Free every unit's gathered parameters, so the next forward gathers them again from the shards. The root keeps
    its gathered copy after a forward (it is needed again at once in backward): after writing into the shards
    directly, that copy is stale."""
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def set_gradient_sync(model: nn.Module, *, enabled: bool) -> None:
    """Skip the reduce-scatter on all but a step's last micro-batch (gradients accumulate locally until then)."""
    if is_sharded(model):
        model.set_requires_gradient_sync(enabled)


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU under their unsharded names. Sharded: a collective every rank calls
    (one all-gather per tensor); rank 0 receives the weights, the others an empty dict."""
    keep = not is_sharded(model) or dist.get_rank() == 0
    full = {}
    for name, tensor in model.state_dict().items():
        tensor = _gathered(tensor)
        if keep:
            full[name] = tensor.detach().cpu()
    return full


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Sharded: the optimizer state keyed by parameter name, gathered to rank 0 (a collective; the other ranks
    get an empty dict). Unsharded: `optimizer.state_dict()`."""
    state = optimizer.state_dict()
    if not is_sharded(model):
        return state
    by_name = optimizer_state_for(model, optimizer, state, by_name=True)
    gathered = {name: {key: _gathered(value).cpu() for key, value in moments.items()}
                for name, moments in by_name["state"].items()}
    return {"state": gathered, "param_groups": by_name["param_groups"]} if dist.get_rank() == 0 else {}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None, *,
                    model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any] | None) -> None:
    """Put a full (unsharded) checkpoint into `model` and `optimizer`, sharded or not; every rank passes the full state."""
    if is_sharded(model):
        current = model.state_dict()
        model_state = {name: _like(tensor, current[name]) if name in current else tensor
                       for name, tensor in model_state.items()}
    model.load_state_dict(model_state)
    if optimizer is None or optimizer_state is None:
        return
    state = optimizer_state_for(model, optimizer, optimizer_state, by_name=False)
    if is_sharded(model):
        params = [param for group in optimizer.param_groups for param in group["params"]]
        state = {**state, "state": {index: {key: _like(value, params[index]) for key, value in moments.items()}
                                    for index, moments in state["state"].items()}}
    optimizer.load_state_dict(state)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _like(full: Any, sharded: torch.Tensor) -> Any:
    """`full` cut the way `sharded` is (a parameter or an optimizer moment of the same shape); scalars stay whole, and
    so do values that are not tensors (a step saved as a number, as torch before 1.12 saved AdamW's)."""
    if isinstance(full, torch.Tensor) and isinstance(sharded, DTensor) and full.shape == sharded.shape:
        return distribute_tensor(full.to(sharded.dtype), sharded.device_mesh, sharded.placements)
    return full


def optimizer_state_for(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any], *,
                        by_name: bool) -> dict[str, Any]:
    """`state` keyed the way the loader needs: by parameter name (sharded) or by index (`Optimizer.load_state_dict`).

    The optimizer's param groups list the same parameters in the same order whichever way a
    checkpoint was written, so position k of group g maps an index to a name.
    """
    names = {id(param): name for name, param in model.named_parameters()}
    group_names = [[names[id(param)] for param in group["params"]] for group in optimizer.param_groups]
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(group_names) or any(len(s["params"]) != len(g) for s, g in zip(saved_groups, group_names)):
        raise ValueError("the checkpoint's optimizer state does not match this model's parameters")
    keyed_by_name = any(isinstance(key, str) for group in saved_groups for key in group["params"])
    if keyed_by_name == by_name:
        return state
    mapping: dict[Any, Any] = {}
    index = 0
    for saved, current in zip(saved_groups, group_names):
        for key, name in zip(saved["params"], current):
            mapping[key] = name if by_name else index
            index += 1
    return {
        "state": {mapping[key]: value for key, value in state["state"].items()},
        "param_groups": [{**group, "params": [mapping[key] for key in group["params"]]} for group in saved_groups],
    }
