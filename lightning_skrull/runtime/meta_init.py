"""Models built on the meta device on some ranks: agree on it, and fill them from rank 0.

A model from :func:`~lightning_skrull.models.loading.from_pretrained_on_rank_zero` holds its
weights on global rank 0 and meta tensors (shapes, no memory) everywhere else. All ranks agree
on that with one all-reduce (:func:`agree_on_meta_tensors`), so every rank takes the same branch
at setup. After ``fully_shard``, :func:`fill_from_rank_zero` gives the meta ranks real storage
(``to_empty``) and copies rank 0's full weights into every rank's shards
(``set_model_state_dict(..., broadcast_from_rank0=True)``), then broadcasts every buffer, since
non-persistent ones (the rotary embedding's ``inv_freq``) are not in a state dict.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Names of ``module``'s parameters and buffers on the meta device."""
    named = itertools.chain(module.named_parameters(), module.named_buffers())
    return [name for name, t in named if t.is_meta]


@dataclasses.dataclass(frozen=True)
class MetaTensors:
    """Where the ranks hold meta tensors, the same answer on every rank.

    Attributes:
        anywhere: some rank's module has a parameter or buffer on the meta device.
        on_rank_zero: global rank 0's model has one (there is nothing to fill the others from).
        outside_model: some rank has one outside the model that can be filled from rank 0.
        local: the names of this rank's meta tensors (for error messages).
        local_outside: those of them outside the model.
    """

    anywhere: bool
    on_rank_zero: bool
    outside_model: bool
    local: tuple[str, ...]
    local_outside: tuple[str, ...]

    def on_this_rank(self) -> str:
        """`` ([first names] on this rank)`` for an error message, or ``""`` when none."""
        return f" ({list(self.local[:3])} on this rank)" if self.local else ""


def agree_on_meta_tensors(module: nn.Module, model: nn.Module, device: torch.device) -> MetaTensors:
    """Find meta tensors in ``module`` (``model`` inside it) on every rank: one all-reduce.

    Args:
        module: the whole module (the LightningModule).
        model: the part of it that :func:`fill_from_rank_zero` can fill.
        device: where the flags are reduced (the process group's device).
    """
    local = meta_tensor_names(module)
    inside = {id(t) for t in itertools.chain(model.parameters(), model.buffers()) if t.is_meta}
    named = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
    outside = [name for name in local if id(named[name]) not in inside]
    rank = dist.get_rank() if dist.is_initialized() else 0
    flags = torch.tensor(
        [bool(local), bool(inside) and rank == 0, bool(outside)], dtype=torch.int32, device=device
    )
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    anywhere, on_rank_zero, outside_model = (bool(f) for f in flags.tolist())
    return MetaTensors(anywhere, on_rank_zero, outside_model, tuple(local), tuple(outside))


def fill_from_rank_zero(
    model: nn.Module, full_state: dict[str, Tensor], device: torch.device
) -> None:
    """Give a sharded model's meta tensors storage and fill them from global rank 0 (collective).

    Call it on every rank after ``fully_shard``: ``full_state`` is rank 0's full state dict,
    captured before sharding (an empty dict on the other ranks). Rank 0's shards already hold
    their values; the others ``to_empty(device=device)`` first. Then every shard is copied from
    rank 0's tensors (cast to the shard's dtype) and every buffer is broadcast from rank 0. Tied
    parameters stay one parameter (FSDP2's ``to_empty`` keeps the parameter objects).
    """
    if meta_tensor_names(model):
        model.to_empty(device=device)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, cast(dict[str, Any], full_state), options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)
