"""Generate with a model prepared for Skrull, e.g. from a callback in the middle of training.

A prepared model runs the ``"skrull"`` attention, which needs a micro-batch's attention context,
without a KV cache, and with the chunked loss's forward. :func:`plain_attention` undoes all three
for the ``with`` block and puts them back on exit, even when the block raises:

- the attention goes back to transformers' own (the one the model had before
  :func:`~lightning_skrull.models.prepare_model`, else ``"sdpa"``), so the no-cache pre-hook
  stands aside and ``generate`` keeps its KV cache;
- the chunked loss's instance ``forward`` is taken off: ``generate`` reads the forward's
  signature to decide whether to pass ``attention_mask``, ``position_ids`` and
  ``logits_to_keep``, and the wrapper's ``(*args, **kwargs)`` would hide them (a left-padded
  batch would then attend to its padding);
- every module is put in eval mode and the block runs under ``torch.no_grad``;
- a model sharded by FSDP2 in a world of several processes calls ``generate`` with
  ``synced_gpus=True``: each forward all-gathers parameters, so a rank whose sequences have
  ended keeps running forwards until every rank's have (transformers turns this on by itself
  only for models it sharded itself); on exit the parameters FSDP2 left gathered are freed, or
  the next step's gradients of the root module's parameters would be wrong.

The buffers (a dynamic RoPE's ``inv_freq``) and training flags are restored as they were, and
so are the instance's own ``forward`` and ``generate``: what a strategy sets inside the block
(``SkrullFSDPStrategy.generating`` wraps ``generate`` to meet the other ranks) is taken off on
exit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lightning_skrull.attention.backends import ATTENTION_NAME
from lightning_skrull.attention.context import has_attention_context
from lightning_skrull.models.chunked_loss import uses_chunked_loss
from lightning_skrull.models.patching import find_hf_model, plain_attention_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextmanager
def plain_attention(
    module: nn.Module,
    *,
    attribute: str | None = None,
    attn_implementation: str | None = None,
) -> Iterator[PreTrainedModel]:
    """Run the Hugging Face model inside ``module`` on transformers' attention, for generation.

    Inside the block the model runs transformers' attention with a KV cache, in eval mode, under
    ``torch.no_grad``; on exit its attention, forward, training flags and buffers are as they
    were (the ``"skrull"`` attention again for a prepared model), also when the block raises.
    Nested blocks and models that were never prepared work too: only what differs is switched.
    See the module docstring for each change. Under a Skrull strategy,
    ``trainer.strategy.generating()`` adds the precision of the validation step.

    Args:
        module: a ``PreTrainedModel``, or a module holding one (a LightningModule, a DDP
            wrapper); found with :func:`~lightning_skrull.models.find_hf_model`.
        attribute: dotted name of the model in ``module`` when it holds several.
        attn_implementation: the attention to generate with; default: the model's attention
            before :func:`~lightning_skrull.models.prepare_model` (else ``"sdpa"``) for a
            prepared model, its current one otherwise.

    Yields:
        The Hugging Face model: call ``generate`` on it (under DDP this is the inner model, so
        one rank may generate alone; under FSDP every rank must call ``generate`` the same
        number of times).

    Raises:
        RuntimeError: entered inside a micro-batch (a ``training_step`` / ``validation_step``
            of a Skrull strategy, or before its last backward), where the forward would run in
            the micro-batch's attention context.
        ValueError: ``module`` holds no Hugging Face model, or several and no ``attribute``.
    """
    if has_attention_context():
        raise RuntimeError(
            "plain_attention(...) was entered inside a Skrull micro-batch (a training_step, "
            "validation_step or test_step, or before the step's last backward). Generate from a "
            "hook that runs once per step or epoch: on_train_batch_end, on_validation_epoch_end "
            "or a callback's on_train_epoch_end."
        )
    model = find_hf_model(module, attribute=attribute)
    before = model.config._attn_implementation
    target = attn_implementation
    if target is None:
        target = plain_attention_name(model) if before == ATTENTION_NAME else before
    training = [(m, m.training) for m in model.modules()]
    buffers = [
        (m, name, b, b.clone())
        for m in model.modules()
        for name, b in m._buffers.items()
        if b is not None
    ]
    attributes = vars(model)  # the instance's own forward / generate, put back on exit
    saved: dict[str, Any] = {n: attributes[n] for n in ("forward", "generate") if n in attributes}
    chunked = uses_chunked_loss(model)
    sharded = isinstance(model, FSDPModule)
    synced = sharded and dist.is_initialized() and dist.get_world_size() > 1
    try:
        if target != before:
            model.set_attn_implementation(target)
        if chunked:
            del attributes["forward"]
        if synced:
            attributes["generate"] = synced_generate(cast(Any, model).generate)
        model.eval()
        with torch.no_grad():
            yield model
    finally:
        for name in ("forward", "generate"):
            attributes.pop(name, None)
        attributes.update(saved)
        if model.config._attn_implementation != before:
            model.set_attn_implementation(before)
        for m, flag in training:
            m.training = flag
        _restore_buffers(buffers)
        if sharded:
            reshard(model)


def _restore_buffers(buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]) -> None:
    """Put back each buffer object and its values (generation past a dynamic RoPE's threshold
    rewrites ``inv_freq``, in place or as a new tensor)."""
    with torch.no_grad():
        for m, name, tensor, values in buffers:
            if m._buffers.get(name) is not tensor:
                m._buffers[name] = tensor
            if not torch.equal(tensor, values):
                tensor.copy_(values)


def synced_generate(generate: Callable[..., Any]) -> Callable[..., Any]:
    """``generate`` with ``synced_gpus=True``; ``synced_gpus=False`` is refused."""

    @functools.wraps(generate)
    def synced(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("synced_gpus", True) is False:
            raise ValueError(
                "generate(synced_gpus=False) on a model sharded by FSDP: every forward "
                "all-gathers parameters, so a rank whose sequences end early would stop joining "
                "them and the other ranks would hang. Leave synced_gpus unset (it is True here)."
            )
        kwargs["synced_gpus"] = True
        return generate(*args, **kwargs)

    return synced


def reshard(model: nn.Module) -> None:
    """Free the parameters FSDP2 gathered for the forwards of a generation (a local operation).

    FSDP2 keeps the root module's parameters (embeddings, final norm, LM head) gathered after a
    forward, for the backward it expects. Measured on CPU (gloo, HSDP): after one forward of
    the block without this, the next training step updated those parameters wrongly (the
    embeddings off by 1.7e-2 after one SGD step); with it, the step is exact.
    """
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
