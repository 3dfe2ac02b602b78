"""The causal-LM loss without the full logits: a prepared causal LM's forward, routed.

With Qwen2.5's 151,936-token vocabulary the logits (``[tokens, vocab]`` in the compute dtype, its
float32 copy for the loss, and the gradient of both) dominate activation memory. Hugging Face's
causal LMs compute ``lm_head(hidden)`` for every token before the loss function sees anything,
so no loss hook can avoid them. :func:`use_chunked_loss` therefore routes the forward of a
prepared causal LM itself when it is given ``labels``: the decoder runs as before, and
:func:`~lightning_skrull.models.loss_kernels.linear_cross_entropy` takes the final hidden states
and the head's weight (over token chunks, or a fused CUDA kernel), so the result is exactly
transformers' ``ForCausalLMLoss`` of the model's own forward. Here: which architectures' forwards
are exactly ``decoder -> lm_head -> loss`` (:data:`CHUNKED_LOSS_MODEL_TYPES`), what of their
forward the routed one keeps (Granite's ``logits_scaling``, Gemma 3's final logit soft-capping,
the refused router auxiliary loss), and which head computes the logits (:func:`active_lm_head`:
a plain ``nn.Linear``, or peft's trainable copy of it).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, cast

from torch import nn

from lightning_skrull.models.families.moe import MOE_MODEL_TYPES, refuse_router_aux_loss
from lightning_skrull.models.families.vision_language import text_config
from lightning_skrull.models.loss_kernels import (
    check_loss_kernel,
    linear_cross_entropy,
    shifted_target,
)

CHUNKED_LOSS_MODEL_TYPES = (
    "qwen2",
    "qwen3",
    "llama",
    "mistral",
    *MOE_MODEL_TYPES,
    "gemma3_text",
    "gemma3",
    "mistral3",
    "granite",
    "olmo2",
    "olmo3",
    "phi3",
    "glm4",
    "smollm3",
    "ministral",
    "seed_oss",
    "exaone4",
)
"""Architectures whose causal-LM forward is exactly ``decoder -> lm_head -> ForCausalLMLoss``,
with Gemma 3's final logit soft-capping (``config.final_logit_softcapping``:
``cap * tanh(logits / cap)``) applied per chunk when set and the model's forward applies it
(:func:`final_logit_softcap`; ``Gemma3ForConditionalGeneration``, ``gemma3``, whose decoder
``model.model`` runs its text model on text only, does not; nor does Mistral Small 3.x's
``mistral3``), and Granite's division of the logits by
``config.logits_scaling`` applied to the hidden states and head bias before the head (``(h / s)
W^T + b / s``, the same logits up to rounding), so routing it through
:func:`linear_cross_entropy` changes nothing but memory. The Mixture-of-Experts ones add the router auxiliary loss only with
``output_router_logits=True``, which the routed forward refuses
(:func:`~lightning_skrull.models.families.moe.refuse_router_aux_loss`) rather than drop it."""


def _chunked_forward(
    model: nn.Module, original: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """The causal LM's forward with the loss of :func:`linear_cross_entropy` when ``labels``
    are given (``logits`` is then ``None``: the full logits are never formed); the original
    forward otherwise. A loss over the logits calls the model without ``labels`` (and without
    ``shift_labels``) and gets them back. ``output_router_logits=True`` (argument or config) is
    refused with ``labels``: the returned loss would lack the router auxiliary loss."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    signature = _signature(original)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    var_keyword = _var_keyword_name(signature)
    extra = dict(arguments.pop(var_keyword, {})) if var_keyword else {}
    labels = arguments.pop("labels", None)
    if labels is None:
        return original(*args, **kwargs)
    arguments.pop("logits_to_keep", None)
    config = getattr(model, "config", None)
    router_logits = arguments.get("output_router_logits")
    if router_logits is None:
        router_logits = getattr(config, "output_router_logits", False)
    if router_logits:
        refuse_router_aux_loss(model)  # its aux loss would be missing from the loss below
    decoder = cast(nn.Module, model.model)  # checked by check_chunked_loss_supported
    head = active_lm_head(model)
    outputs = decoder(**arguments, **extra)
    hidden, bias = outputs.last_hidden_state, head.bias
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None and scaling != 1:
        # Granite's logits / logits_scaling, as (hidden / s) @ W.T + b / s: only [tokens, hidden]
        hidden = hidden / scaling
        bias = None if bias is None else bias / scaling
    loss = linear_cross_entropy(
        hidden,
        head.weight,
        shifted_target(labels, extra.get("shift_labels")),
        bias=bias,
        num_items_in_batch=extra.get("num_items_in_batch"),
        chunk_tokens=getattr(model, "_skrull_chunk_tokens", None),
        kernel=getattr(model, "_skrull_loss_kernel", "chunked"),
        softcap=final_logit_softcap(model),
    )
    return CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def final_logit_softcap(model: nn.Module) -> float | None:
    """The final logit soft-capping ``model``'s own forward applies (``None``: none).

    ``final_logit_softcapping`` of the model's text config when its class's forward reads that
    field: ``Gemma3ForCausalLM`` does; ``Gemma3ForConditionalGeneration`` computes
    ``lm_head(hidden)`` without it, whatever ``config.text_config`` sets. A forward whose source
    cannot be read is taken to apply a field that is set.
    """
    cap = getattr(text_config(getattr(model, "config", None)), "final_logit_softcapping", None)
    if cap is None or not _forward_reads(type(model).forward, "final_logit_softcapping"):
        return None
    return float(cap)


@functools.cache
def _forward_reads(forward: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.getsource(forward)
    except (OSError, TypeError):
        return True


@functools.cache
def _signature(fn: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(fn)


def _var_keyword_name(signature: inspect.Signature) -> str | None:
    """The name of the forward's ``**`` parameter, where ``shift_labels`` and
    ``num_items_in_batch`` arrive: ``kwargs`` in most models, ``lm_kwargs`` in
    ``Gemma3ForConditionalGeneration`` of transformers 5.17; ``None`` without one."""
    return next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)


def _from_peft(module: nn.Module) -> bool:
    return type(module).__module__.split(".")[0] == "peft"


def _saved_copies(head: nn.Module) -> tuple[nn.Module, nn.ModuleDict] | None:
    """``(original_module, modules_to_save)`` of peft's ``ModulesToSaveWrapper`` (a trainable
    copy of a whole module per adapter, ``modules_to_save=["lm_head"]``), else ``None``."""
    original = getattr(head, "original_module", None)
    copies = getattr(head, "modules_to_save", None)
    if type(head).__name__ != "ModulesToSaveWrapper" or not _from_peft(head):
        return None
    if not isinstance(original, nn.Module) or not isinstance(copies, nn.ModuleDict):
        return None
    return original, copies


def active_lm_head(model: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` that computes ``model``'s logits now.

    ``model.lm_head`` itself, or, when peft wrapped it in a ``ModulesToSaveWrapper``
    (``modules_to_save=["lm_head"]``), the copy its forward would call: the active adapter's
    trainable copy, or the original head while adapters are disabled (peft's own rule).

    Raises:
        ValueError: the head is neither (see :func:`check_chunked_loss_supported`).
    """
    head = getattr(model, "lm_head", None)
    saved = _saved_copies(head) if isinstance(head, nn.Module) else None
    if saved is not None:
        original, copies = saved
        active = list(getattr(head, "active_adapters", ()))
        if getattr(head, "disable_adapters", False) or not active or active[0] not in copies:
            head = original
        else:
            head = copies[active[0]]
    if not isinstance(head, nn.Linear):
        check_chunked_loss_supported(model)  # raises, naming the head
        raise ValueError(f"{type(model).__name__}'s lm_head is not an nn.Linear.")
    return head


def _head_problem(model: nn.Module) -> str | None:
    """Why ``model.lm_head`` cannot be computed from an ``nn.Linear`` weight, or ``None``."""
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Module):
        return "it has no nn.Linear lm_head"
    saved = _saved_copies(head)
    if saved is not None:
        original, copies = saved
        if all(isinstance(m, nn.Linear) for m in (original, *copies.values())):
            return None
    elif isinstance(head, nn.Linear) and not _from_peft(head):
        return None
    if not _from_peft(head):
        return f"its lm_head is a {type(head).__name__}, not an nn.Linear"
    cls = type(head)
    return (
        f"its lm_head is a peft adapter layer ({cls.__module__}.{cls.__qualname__}), and the "
        "chunked loss computes the head from a plain nn.Linear weight, so it would skip the "
        "adapter; leave lm_head out of the peft config's target_modules (and lm_head.weight "
        "out of its target_parameters; modules_to_save=['lm_head'] is supported)"
    )


def check_chunked_loss_supported(model: nn.Module) -> None:
    """Raise unless ``model``'s causal-LM forward can be routed through the chunked loss.

    The head must be an ``nn.Linear``, or peft's ``ModulesToSaveWrapper`` around one
    (``modules_to_save=["lm_head"]``: :func:`active_lm_head` picks the copy in use); a peft
    adapter layer on the head (LoRA in ``target_modules`` or ``target_parameters``) is refused.

    Raises:
        ValueError: the architecture is not one of :data:`CHUNKED_LOSS_MODEL_TYPES`, or the
            model has no ``model`` decoder / ``lm_head`` linear head; the message names the head
            and the fixes.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    reasons = []
    if model_type not in CHUNKED_LOSS_MODEL_TYPES:
        reasons.append(
            f"model_type {model_type!r} is not one whose forward is exactly decoder -> lm_head "
            f"-> cross-entropy ({', '.join(CHUNKED_LOSS_MODEL_TYPES)})"
        )
    head_problem = _head_problem(model)
    if head_problem is not None:
        reasons.append(head_problem)
    if not isinstance(getattr(model, "model", None), nn.Module):
        reasons.append("it has no `model` decoder attribute")
    if reasons:
        raise ValueError(
            f"{type(model).__name__} cannot use the chunked loss: {'; '.join(reasons)}. Pass "
            "chunked_loss=False (to the strategy, or to prepare_model) to compute the loss from "
            "the full logits."
        )


def use_chunked_loss(
    model: nn.Module, *, chunk_tokens: int | None = None, kernel: str = "auto"
) -> None:
    """Route ``model``'s forward through :func:`linear_cross_entropy` when given ``labels``.

    The instance's ``forward`` is replaced (the class is untouched); with ``labels`` the output's
    ``loss`` is transformers' causal-LM loss and ``logits`` is ``None``; without labels the
    original forward runs and returns the logits. Calling it again only updates
    ``chunk_tokens`` and ``kernel``. ``kernel`` is :data:`LossKernel` (default ``"auto"``: a fused
    CUDA kernel when installed and the model runs on CUDA, else the chunked path).

    Raises:
        ValueError: unsupported model (see :func:`check_chunked_loss_supported`), or a kernel
            that is unknown or not installed (:func:`check_loss_kernel`).
    """
    check_chunked_loss_supported(model)
    check_loss_kernel(kernel)
    model._skrull_chunk_tokens = chunk_tokens  # type: ignore[assignment]
    model._skrull_loss_kernel = kernel  # type: ignore[assignment]
    if uses_chunked_loss(model):
        return
    original = type(model).forward.__get__(model)
    forward = functools.partial(_chunked_forward, model, original)
    forward._skrull_chunked = True  # type: ignore[attr-defined]
    model.forward = forward  # type: ignore[method-assign]


def uses_chunked_loss(model: nn.Module) -> bool:
    """Whether :func:`use_chunked_loss` routed ``model``'s forward."""
    return bool(getattr(vars(model).get("forward"), "_skrull_chunked", False))


MISSING_LOGITS_NOTE = (
    "If the None is the model's `.logits`: the model runs the chunked loss (on by default under "
    "the Skrull strategies), which returns logits=None whenever it is given `labels`. For logits, "
    "call it without labels, e.g. self.model(input_ids=batch['input_ids'], "
    "position_ids=batch['position_ids']).logits, and compute the loss with "
    "lightning_skrull.token_mean_loss; or turn the chunked loss off with "
    "SkrullStrategy(chunked_loss=False). See docs/loss.md, 'Custom losses'."
)
"""The note :func:`note_missing_logits` adds to an error."""


def note_missing_logits(error: BaseException, model: nn.Module) -> None:
    """Add :data:`MISSING_LOGITS_NOTE` to ``error`` when it is about a ``None`` (``'NoneType'``
    in its message) and ``model`` runs the chunked loss: the usual cause is reading ``.logits``
    of an output computed with ``labels``. Python 3.10 has no exception notes: nothing is
    added there."""
    if "NoneType" in str(error) and uses_chunked_loss(model) and hasattr(error, "add_note"):
        error.add_note(MISSING_LOGITS_NOTE)


def use_dense_loss(model: nn.Module) -> None:
    """Undo :func:`use_chunked_loss`: the class's forward (with full logits) runs again."""
    if uses_chunked_loss(model):
        del model.forward


__all__ = [
    "CHUNKED_LOSS_MODEL_TYPES",
    "MISSING_LOGITS_NOTE",
    "active_lm_head",
    "check_chunked_loss_supported",
    "final_logit_softcap",
    "note_missing_logits",
    "use_chunked_loss",
    "use_dense_loss",
    "uses_chunked_loss",
]
