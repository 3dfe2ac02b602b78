"""How :class:`~lightning_skrull.strategies.fsdp.SkrullFSDPStrategy` applies FSDP2 to a Hugging
Face model: ``fully_shard`` on each decoder layer and on the model as the root, and what it
refuses to shard."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from lightning_skrull.models.modes import cast_trainable_parameters
from lightning_skrull.strategies.fsdp_precision import FSDPPrecision, check_frozen_dtypes_agree


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face model, the units ``fully_shard`` wraps.

    They are the modules whose class is named in the model's ``_no_split_modules`` (transformers'
    own list of the blocks that must stay whole: ``Qwen2DecoderLayer``, ``LlamaDecoderLayer``).

    Raises:
        ValueError: the model names no such class, or none of its modules is one.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers to shard: its _no_split_modules is "
            f"{sorted(names)!r} and no submodule has one of those classes. SkrullFSDPStrategy "
            "shards Hugging Face decoders (Qwen2/3, Llama, Mistral, their MoE variants); use "
            "SkrullStrategy or SkrullZero2Strategy for other models."
        )
    return layers


def refuse_parameters_outside(module: nn.Module, hf_model: nn.Module) -> None:
    """Refuse trainable parameters of ``module`` (the LightningModule) outside ``hf_model``,
    the one module that is sharded: nothing would reduce their gradients.

    Raises:
        ValueError: there are some; the message names up to five.
    """
    inside = {id(p) for p in hf_model.parameters()}
    outside = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside]
    if outside:
        raise ValueError(
            f"SkrullFSDPStrategy shards the Hugging Face model only, but the LightningModule "
            f"has trainable parameters outside it: {outside[:5]}; their gradients would "
            "never be reduced across ranks. Move them into the model, freeze them "
            "(requires_grad=False), or use SkrullStrategy (DDP)."
        )


def shard_decoder(
    hf_model: nn.Module,
    *,
    mesh: DeviceMesh,
    precision: FSDPPrecision,
    device: torch.device,
    reshard_after_forward: bool,
) -> None:
    """Shard ``hf_model`` over ``mesh``: ``fully_shard`` on each of its :func:`decoder_layers`,
    then on the model as the root (embeddings, final norm, LM head), with ``precision``'s
    policies. Trainable parameters are cast to the master dtype one unit at a time, just before
    it is sharded. A collective (the frozen dtypes are compared across ranks first).

    Raises:
        ValueError: the ranks hold frozen parameters in different dtypes
            (:func:`~lightning_skrull.strategies.fsdp_precision.check_frozen_dtypes_agree`), or
            the model has no decoder layers.
    """
    policy = precision.mixed_precision_policy
    check_frozen_dtypes_agree(hf_model, device)
    for layer in decoder_layers(hf_model):
        cast_trainable_parameters(layer, precision.master_dtype)
        fully_shard(
            layer,
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    cast_trainable_parameters(hf_model, precision.master_dtype)
    fully_shard(hf_model, mesh=mesh, mp_policy=precision.root_policy)
