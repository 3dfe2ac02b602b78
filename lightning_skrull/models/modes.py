"""Training mode at the start of a fit: what ``from_pretrained`` leaves, and what it switches off.

transformers' ``from_pretrained`` returns the model in eval mode (``model.eval()``), and
Lightning keeps the modes it finds when a fit starts (it only warns about modules in eval mode).
A model loaded the usual way therefore trains in eval mode under plain Lightning, and in eval
mode transformers skips what it does only in training: above all activation checkpointing
(``gradient_checkpointing_enable()``, ``SkrullFSDPStrategy(activation_checkpointing=True)``),
whose layers recompute only ``if self.gradient_checkpointing and self.training``. The memory a
bucket was sized for would then be exceeded with no error until the device runs out.

:func:`train_mode_for_fit` decides, when a Skrull strategy starts a fit:

- a model wholly in eval mode is what ``from_pretrained`` returns: it is put in training mode,
  as transformers' own ``Trainer`` does at the start of training;
- a model whose modes are mixed was set so on purpose and is left alone, unless some layer that
  would checkpoint its activations is in eval mode: that is refused, since its checkpointing
  would silently not run.

:func:`cast_trainable_parameters` gives the trainable parameters the dtype the optimizer steps
(float32 master weights under ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"``), in place,
for :class:`~lightning_skrull.SkrullStrategy` and :class:`~lightning_skrull.SkrullFSDPStrategy`
alike; frozen parameters keep the dtype they were loaded in.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def cast_trainable_parameters(
    module: nn.Module, dtype: torch.dtype, *, from_dtypes: Collection[torch.dtype] | None = None
) -> int:
    """Cast ``module``'s trainable floating-point parameters to ``dtype`` in place.

    The :class:`~torch.nn.Parameter` objects stay (only their data changes), so an optimizer
    built on them keeps them. Frozen parameters keep the dtype they were loaded in, and
    parameters already sharded (DTensors: FSDP2 cast them before sharding) are left alone.

    Args:
        module: the module whose parameters (its submodules' included) are cast.
        dtype: the dtype to cast to.
        from_dtypes: cast only parameters of these dtypes (``SkrullStrategy``: bf16 and fp16,
            so a float64 parameter stays float64); ``None``: every floating-point dtype.

    Returns:
        The number of parameters cast.
    """
    cast = 0
    for p in module.parameters():
        if (
            p.requires_grad
            and p.is_floating_point()
            and p.dtype != dtype
            and (from_dtypes is None or p.dtype in from_dtypes)
            and not isinstance(p, DTensor)
        ):
            p.data = p.data.to(dtype)
            cast += 1
    return cast


def train_mode_for_fit(model: nn.Module) -> bool:
    """Put ``model`` in training mode for a fit if every module of it is in eval mode.

    Returns:
        Whether the model was switched to training mode.

    Raises:
        ValueError: the modes are mixed and some module with activation checkpointing enabled
            is in eval mode; the message names the modules and the fix.
    """
    modules = list(model.named_modules())
    if not any(module.training for _, module in modules):
        model.train()
        return True
    idle = [
        name or type(module).__name__
        for name, module in modules
        if getattr(module, "gradient_checkpointing", False) is True and not module.training
    ]
    if idle:
        shown = ", ".join(idle[:3]) + (f" and {len(idle) - 3} more" if len(idle) > 3 else "")
        raise ValueError(
            f"{len(idle)} module(s) of {type(model).__name__} have activation checkpointing "
            f"enabled but are in eval mode ({shown}), and transformers checkpoints a layer only "
            "in training mode: they would keep every activation, beyond the memory the buckets "
            "are sized for. Call .train() on the model before fitting (from_pretrained returns "
            "it in eval mode), or disable their checkpointing."
        )
    return False
