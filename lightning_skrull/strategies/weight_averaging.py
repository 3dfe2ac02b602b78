"""Lightning's weight-averaging callbacks under the Skrull strategies.

Lightning's ``WeightAveraging`` (``EMAWeightAveraging``, or any ``torch.optim.swa_utils``
averaging function) and ``StochasticWeightAveraging`` copy the LightningModule in their ``setup``
hook, which runs before the strategy's ``setup`` prepares, casts or shards the model. They then
pair the copy's tensors with the module's by position (``zip`` over ``parameters()`` and then
``buffers()``, with no check) to update the average, to swap it in around validation and to copy
it in when training ends. That is right only while both hold tensors of the same names, order and
shapes, and the copy's dtype holds the module's values exactly (the swap copies them there and
back).

- :class:`~lightning_skrull.SkrullStrategy` adds no parameter or buffer (the Skrull attention,
  the ``use_cache`` hook and the chunked loss change forwards only), but it casts trainable
  16-bit parameters to float32 master weights after the copy was made: the copy is cast alike
  (:func:`match_averaged_dtypes`), or the EMA would accumulate in bf16 and every validation swap
  would round the float32 weights to bf16.
- :class:`~lightning_skrull.SkrullFSDPStrategy` and
  :class:`~lightning_skrull.SkrullZero2Strategy` refuse the callbacks at setup
  (:func:`refuse_weight_averaging`, with their reasons).

:func:`check_averaged_pairs` checks the pairing once the strategy is set up.
:func:`refuse_batch_norm_update` refuses ``StochasticWeightAveraging`` on a module with BatchNorm
layers: the callback recomputes their statistics in an extra epoch run as one optimizer step,
which a Skrull step (one global batch) cannot be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from lightning.pytorch.callbacks import Callback, StochasticWeightAveraging, WeightAveraging
from torch import nn

if TYPE_CHECKING:
    import lightning.pytorch as pl

AVERAGING_CALLBACKS = (WeightAveraging, StochasticWeightAveraging)
"""Lightning's callbacks that keep an averaged copy of the LightningModule."""


def averaging_callbacks(trainer: pl.Trainer) -> list[Callback]:
    """The Trainer's weight-averaging callbacks (:data:`AVERAGING_CALLBACKS`)."""
    return [cb for cb in trainer.callbacks if isinstance(cb, AVERAGING_CALLBACKS)]  # type: ignore[attr-defined]


def averaged_copies(trainer: pl.Trainer) -> list[tuple[Callback, nn.Module]]:
    """``(callback, its copy of the LightningModule)`` for each weight-averaging callback that
    made one (``WeightAveraging`` makes it in ``setup("fit")`` only).

    Lightning keeps the copy private (``_average_model``: a ``torch.optim.swa_utils.
    AveragedModel`` around it, or the copy itself for ``StochasticWeightAveraging``);
    tests/strategies/test_weight_averaging.py fails if that changes.
    """
    out: list[tuple[Callback, nn.Module]] = []
    for callback in averaging_callbacks(trainer):
        average = getattr(callback, "_average_model", None)
        if isinstance(average, torch.optim.swa_utils.AveragedModel):
            out.append((callback, average.module))
        elif isinstance(average, nn.Module):
            out.append((callback, average))
    return out


def refuse_weight_averaging(trainer: pl.Trainer, strategy: str, reason: str) -> None:
    """Refuse a fit with a weight-averaging callback under ``strategy``, for ``reason``.

    Raises:
        ValueError: the Trainer fits with such a callback; the message names it, the reason and
            the fix.
    """
    callbacks = averaging_callbacks(trainer)
    if not callbacks or trainer.state.fn != "fit":
        return
    name = type(callbacks[0]).__name__
    raise ValueError(
        f"{name} cannot average the weights under {strategy}: {reason}. Train with "
        f"SkrullStrategy (DDP, a full model on every rank), under which {name} averages exactly "
        "what one process would, or remove the callback."
    )


def refuse_batch_norm_update(trainer: pl.Trainer, module: nn.Module, strategy: str) -> None:
    """Refuse ``StochasticWeightAveraging`` on a module with BatchNorm layers.

    With BatchNorm layers (and ``max_epochs`` set) the callback adds an epoch after training
    that recomputes their statistics under the average, run as one optimizer step by setting
    ``Trainer.accumulate_grad_batches`` to the epoch's batch count. A Skrull step is one global
    batch whose micro-batches are already accumulated, so the strategy would refuse that setting
    at the extra epoch's first step, after the whole training.

    Raises:
        ValueError: such a fit; the message names the layer, the rule and the fix.
    """
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, StochasticWeightAveraging)]  # type: ignore[attr-defined]
    if not callbacks or trainer.state.fn != "fit" or trainer.max_epochs == -1:
        return
    layers = [
        (name, type(m).__name__)
        for name, m in module.named_modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
    ]
    if not layers:
        return
    name, kind = layers[0]
    raise ValueError(
        f"StochasticWeightAveraging recomputes the statistics of the BatchNorm layer {name!r} "
        f"({kind}) in an extra epoch after training, run as one optimizer step "
        "(Trainer.accumulate_grad_batches set to the epoch's batch count), but under "
        f"{strategy} one global batch is one step. Average with lightning.pytorch.callbacks."
        "WeightAveraging(avg_fn=torch.optim.swa_utils.get_swa_avg_fn()) and recompute the "
        "statistics after fit with torch.optim.swa_utils.update_bn, or remove the callback."
    )


def _tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s parameters and then its buffers, in the order the callbacks pair them."""
    return [*module.named_parameters(), *module.named_buffers()]


def match_averaged_dtypes(trainer: pl.Trainer, module: nn.Module) -> int:
    """Cast each 16-bit tensor of the averaged copies to float32 where ``module``'s tensor of
    that name is float32 now (the float32 master cast ran after the copy was made); returns how
    many were cast."""
    current = dict(_tensors(module))
    cast = 0
    for _, copy in averaged_copies(trainer):
        for name, tensor in _tensors(copy):
            live = current.get(name)
            if live is not None and _is_16_bit(tensor.dtype) and live.dtype == torch.float32:
                tensor.data = tensor.data.float()
                cast += 1
    return cast


def _is_16_bit(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 2


def _holds_exactly(average: torch.dtype, current: torch.dtype) -> bool:
    """Whether a copy in ``average`` holds every value of ``current`` (float32 holds bf16 and
    fp16 values exactly)."""
    return average == current or (average == torch.float32 and _is_16_bit(current))


def check_averaged_pairs(trainer: pl.Trainer, module: nn.Module, strategy: str) -> None:
    """Check that every averaged copy pairs with ``module`` tensor by tensor, as the callbacks
    pair them: the same names in the same order, the same shapes, and a dtype that holds the
    module's values exactly (the same, or float32 for a 16-bit tensor).

    Raises:
        RuntimeError: a pair differs; the message names the callback, the tensor and the fix.
    """
    current = _tensors(module)
    for callback, copy in averaged_copies(trainer):
        average = _tensors(copy)
        problem = None
        if [n for n, _ in average] != [n for n, _ in current]:
            names = {n for n, _ in current} ^ {n for n, _ in average}
            problem = (
                f"its copy holds {len(average)} parameters and buffers and the module "
                f"{len(current)}, or in another order (names in one only: {sorted(names)[:5]})"
            )
        else:
            for (name, a), (_, c) in zip(average, current, strict=True):
                if a.shape != c.shape or not _holds_exactly(a.dtype, c.dtype):
                    problem = (
                        f"{name!r} is {a.dtype} {tuple(a.shape)} in its copy but {c.dtype} "
                        f"{tuple(c.shape)} in the module"
                    )
                    break
        if problem is not None:
            raise RuntimeError(
                f"{type(callback).__name__} pairs its copy of the LightningModule with the "
                f"module tensor by tensor, in order, but after {strategy}'s setup {problem}; "
                "averaging would mix up tensors or lose precision. Build every parameter and "
                "buffer before trainer.fit (not in configure_model or a setup hook), in the "
                "dtype it trains in."
            )
