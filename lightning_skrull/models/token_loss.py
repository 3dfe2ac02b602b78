"""Custom losses under Skrull: the normalisation rule as a function.

A Skrull step runs several micro-batches per rank (a different number on each DP rank) and
averages the gradients over the ``W = dp_size * cp_size`` ranks. The step's gradient is the one
of single-process training's global token mean only when each micro-batch's loss is

    sum of its supervised tokens' losses / batch["num_items_in_batch"]

(``num_items_in_batch`` is the whole global batch's supervised tokens over ``W``; docs/loss.md
derives it). A mean over the micro-batch's tokens weighs every micro-batch alike however many
tokens it holds, and trains on another objective without any error. :func:`token_mean_loss`
applies the rule to per-token losses of any kind (label smoothing, per-token weights, a z-loss
term): ``token_mean_loss(token_losses, batch)``, with ``token_losses`` aligned with
:func:`shifted_labels` (``batch["shift_labels"]``). On a batch without ``num_items_in_batch``
(a plain strategy's) it is the mean over the supervised tokens, as transformers computes it, so
the same LightningModule trains under either.

The Skrull strategies recognise the values :func:`token_mean_loss` returns (it reports each to
the observers :func:`observe_token_mean_losses` registers): they are summed like the model's own
loss when combined over a step's micro-batches, and a training step that returns neither kind
gets one :class:`CustomLossWarning` per fit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_skrull.models.loss_kernels import IGNORE_INDEX, shifted_target

_observers: OrderedDict[int, Callable[[Tensor], None]] = OrderedDict()
"""What :func:`observe_token_mean_losses` registered (an ``OrderedDict``: the handles keep a
weak reference to it, as torch's own hook dicts)."""


class CustomLossWarning(UserWarning):
    """A training step returned a loss that is neither the model's own ``.loss`` nor made by
    :func:`token_mean_loss`, so its normalisation cannot be checked.

    Silence it once the loss is known to follow the rule (a sum over tokens divided by
    ``batch["num_items_in_batch"]``)::

        warnings.filterwarnings("ignore", category=lightning_skrull.CustomLossWarning)
    """


CUSTOM_LOSS_MESSAGE = (
    "training_step returned a loss that is neither the model's own `.loss` nor made by "
    "lightning_skrull.token_mean_loss. Under Skrull each micro-batch's loss must be the sum of "
    "its token losses divided by batch['num_items_in_batch'] (DP ranks run different numbers of "
    "micro-batches and the gradients are averaged over ranks); a mean over the micro-batch's "
    "tokens (e.g. F.cross_entropy(..., reduction='mean')) trains on another objective without "
    "any error. Compute per-token losses (reduction='none') against "
    "lightning_skrull.shifted_labels(batch) (the labels are shifted already: do not shift them "
    "again) and return lightning_skrull.token_mean_loss(token_losses, batch); see docs/loss.md, "
    "'Custom losses'. If your loss follows the rule, silence this with warnings.filterwarnings("
    "'ignore', category=lightning_skrull.CustomLossWarning)."
)
"""The text of the :class:`CustomLossWarning`."""


def shifted_labels(batch: Mapping[str, Any]) -> Tensor:
    """The target of every token of ``batch``: ``batch["shift_labels"]`` when present (a Skrull
    micro-batch's labels, shifted per sequence before sharding: use them as they are), else
    ``batch["labels"]`` shifted left by one with ``-100`` appended (transformers' rule for an
    unshifted batch). ``-100`` marks a token without a target.

    Raises:
        KeyError: the batch has neither key.
    """
    shift = batch.get("shift_labels")
    if shift is not None:
        return shift
    labels = batch.get("labels")
    if labels is None:
        raise KeyError(
            f"the batch has no 'shift_labels' or 'labels' (its keys: {sorted(batch)}); a causal "
            "LM's token losses need the labels the batch was built with."
        )
    return shifted_target(labels, None)


def token_mean_loss(token_losses: Tensor, batch: Mapping[str, Any]) -> Tensor:
    """A micro-batch's loss from its per-token losses, normalised so a Skrull step trains on the
    global token mean.

    Args:
        token_losses: one loss per token, aligned with :func:`shifted_labels` of ``batch``
            (the same shape or the same number of elements, e.g. ``[1, T]`` or ``[T]``), such
            as ``F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none")``.
            Tokens whose target is ``-100`` are left out whatever their value.
        batch: the micro-batch (the keyword arguments the strategy handed to ``training_step``).

    Returns:
        A 0-dim float32 tensor: the sum of the supervised tokens' losses divided by
        ``batch["num_items_in_batch"]`` when the batch has it (every Skrull micro-batch), else
        their mean (``0`` when there are none).

    Raises:
        KeyError: the batch has no labels (:func:`shifted_labels`).
        ValueError: ``token_losses`` does not hold one value per token of the batch.
    """
    targets = shifted_labels(batch)
    if token_losses.numel() != targets.numel():
        raise ValueError(
            f"token_mean_loss got token losses of shape {tuple(token_losses.shape)} for labels "
            f"of shape {tuple(targets.shape)}; it needs one loss per token (e.g. "
            "F.cross_entropy(..., reduction='none')), not a loss already reduced over tokens."
        )
    targets = targets.reshape(token_losses.shape).to(token_losses.device)
    supervised = targets != IGNORE_INDEX
    total = torch.where(supervised, token_losses.float(), 0.0).sum()
    count = batch.get("num_items_in_batch")
    if count is None:
        loss = total / supervised.sum().clamp_min(1)
    else:
        loss = total / torch.as_tensor(count, device=total.device)
    for observe in tuple(_observers.values()):
        observe(loss)
    return loss


def observe_token_mean_losses(callback: Callable[[Tensor], None]) -> RemovableHandle:
    """Call ``callback`` with every loss :func:`token_mean_loss` returns until the handle's
    ``remove()`` (the strategies note a step's losses this way)."""
    handle = RemovableHandle(_observers)
    _observers[handle.id] = callback
    return handle


__all__ = [
    "CUSTOM_LOSS_MESSAGE",
    "CustomLossWarning",
    "observe_token_mean_losses",
    "shifted_labels",
    "token_mean_loss",
]
