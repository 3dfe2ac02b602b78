"""Write trained weights as a Hugging Face checkpoint (or a peft adapter) from a full state dict.

Every strategy gathers the model's full weights its own way (DDP: the model itself; ZeRO-2: the
float32 master copies from the optimizer partitions; FSDP: the unsharded shards) and hands them
to :func:`write_pretrained`, which writes what plain transformers / peft load:

- a Hugging Face model: ``config.json`` (with ``architectures`` naming the model's own class,
  not a wrapper's or FSDP's subclass, and ``dtype`` the dtype of the written weights, which
  ``from_pretrained(..., dtype="auto")`` loads them in), ``generation_config.json`` and the
  safetensors files;
- a peft ``PeftModel``: the adapter, in peft's format (:func:`~lightning_skrull.models.adapters.save_adapter`).

The weights are written in the dtype they have in the state dict (what the optimizer stepped),
or all cast to one ``dtype``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_skrull.models.adapters import find_peft_model, save_adapter


def check_save_dtype(dtype: torch.dtype | None) -> None:
    """Refuse a ``dtype`` to save in that is not a floating-point ``torch.dtype``.

    Raises:
        ValueError: the message names the value and the dtypes that work.
    """
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return
    raise ValueError(
        f"save_pretrained(dtype={dtype!r}): dtype casts the floating-point weights, so it must "
        "be a floating-point torch.dtype (torch.float32, torch.bfloat16, torch.float16), or "
        "None to write each weight in the dtype it trained in."
    )


def written_dtype(state: dict[str, Tensor]) -> torch.dtype:
    """The dtype recorded in ``config.json`` for ``state``: the floating-point weights' one
    dtype, or, when they have several (a frozen bf16 part beside float32 trained weights), the
    widest of float32 and theirs, so that loading casts nothing down."""
    dtypes = {t.dtype for t in state.values() if t.is_floating_point()}
    if len(dtypes) == 1:
        return next(iter(dtypes))
    return torch.float64 if torch.float64 in dtypes else torch.float32


def cpu_state_dict(model: nn.Module, replace: dict[int, Tensor] | None = None) -> dict[str, Tensor]:
    """``model.state_dict()`` detached on CPU, tied weights still one tensor; ``replace`` maps
    ``id(parameter)`` to the values to write for that parameter instead (under every name it
    has)."""
    replace = replace or {}
    copies: dict[int, Tensor] = {}
    state: dict[str, Tensor] = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) not in copies:
            copies[id(value)] = replace.get(id(value), value).detach().cpu()
        state[key] = copies[id(value)]
    return state


def model_class(model: nn.Module) -> type:
    """The model's own class: FSDP2's ``fully_shard`` swaps it for a subclass of it."""
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def write_pretrained(
    module: nn.Module,
    hf_model: nn.Module,
    state: dict[str, Tensor],
    directory: str | Path,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """Write ``hf_model``'s trained weights ``state`` into ``directory`` (on one process).

    Args:
        module: what holds ``hf_model`` (the LightningModule); a peft ``PeftModel`` between
            them makes the adapter the thing written.
        hf_model: the Hugging Face model (sharded or not); its config and generation config are
            written along.
        state: ``hf_model``'s full state dict (keys relative to it, CPU tensors), as trained.
        directory: the folder to write (created if missing).
        dtype: cast every floating-point tensor to it; ``None`` writes each as it is in
            ``state``.

    Raises:
        ValueError: ``dtype`` is not a floating-point ``torch.dtype``.
    """
    check_save_dtype(dtype)
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    peft_model = find_peft_model(module, hf_model)
    if peft_model is not None:
        save_adapter(peft_model, hf_model, state, directory)
        return
    model: Any = hf_model
    saved_dtype = written_dtype(state)
    # a copy: transformers empties the dict it is given as it writes
    model.save_pretrained(str(directory), state_dict=dict(state))
    # save_pretrained records the class and the dtype of the model object, which can be a
    # wrapper's subclass and bf16 copies of float32 weights (ZeRO-2's bf16 model)
    config = copy.deepcopy(model.config)
    config.architectures = [model_class(hf_model).__name__]
    config.dtype = saved_dtype
    config.save_pretrained(str(directory))


__all__ = ["check_save_dtype", "cpu_state_dict", "model_class", "write_pretrained", "written_dtype"]
