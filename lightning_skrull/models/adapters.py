"""Models with peft adapters (LoRA and the other tuners): build, check and save them.

A peft ``PeftModel`` wraps the Hugging Face model (``PeftModel -> LoraModel -> Qwen2ForCausalLM``)
and replaces some of its ``nn.Linear`` layers with adapter layers that hold the frozen base
weight and the trainable adapter weights. The strategies find the inner Hugging Face model
(:func:`~lightning_skrull.models.patching.find_hf_model`) and run it as any other; only three
things need to know about peft:

- the chunked loss computes the head from a plain ``nn.Linear`` weight, so an adapter layer on
  ``lm_head`` is refused and peft's ``modules_to_save`` copy of it is resolved
  (:mod:`lightning_skrull.models.chunked_loss`);
- reentrant activation checkpointing gives the adapters of the checkpointed layers no gradient
  when the layers' input does not require one (:func:`check_checkpointing_gradients`);
- the trained adapter is saved in peft's format, not as a full model
  (:func:`save_adapter`).

peft is optional: nothing here imports it until :func:`apply_lora` or :func:`save_adapter`
runs, and a model can only be a ``PeftModel`` when peft was imported to build it.
"""

from __future__ import annotations

import functools
import importlib
import sys
from pathlib import Path
from typing import Any

from torch import Tensor, nn

PEFT_INSTALL_HINT = 'pip install peft (or "lightning-skrull[peft]")'


def find_peft_model(module: nn.Module, hf_model: nn.Module) -> nn.Module | None:
    """The peft ``PeftModel`` inside ``module`` that wraps ``hf_model``, or ``None``.

    ``None`` without a look at the modules when peft was never imported (no model can be a
    ``PeftModel`` then).
    """
    peft = sys.modules.get("peft")
    if peft is None:
        return None
    for candidate in module.modules():
        if isinstance(candidate, peft.PeftModel) and any(
            sub is hf_model for sub in candidate.modules()
        ):
            return candidate
    return None


def _reentrant_checkpointing(model: nn.Module) -> bool:
    """Whether some layer of ``model`` recomputes its activations with reentrant checkpointing
    (transformers' ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={
    "use_reentrant": True})``)."""
    for module in model.modules():
        if not getattr(module, "gradient_checkpointing", False):
            continue
        function = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(function, functools.partial) and function.keywords.get("use_reentrant", True):
            return True
    return False


def check_checkpointing_gradients(model: nn.Module) -> None:
    """Refuse reentrant activation checkpointing that would leave trainable parameters without
    gradients.

    Reentrant checkpointing (``torch.utils.checkpoint(..., use_reentrant=True)``) builds a
    layer's backward only when one of the tensors passed to it requires a gradient. With frozen
    input embeddings (LoRA, or any partly frozen model) the hidden states entering the first
    layer do not, and the adapters inside the checkpointed layers get no gradient, silently
    when something after the layers is trainable. transformers guards against it with a forward
    hook on the input embeddings that marks their output as requiring a gradient
    (``enable_input_require_grads``, installed by ``gradient_checkpointing_enable`` and by peft);
    a model with reentrant checkpointing, frozen input embeddings, trainable parameters and no
    such hook is refused. Non-reentrant checkpointing (transformers' default) needs nothing.

    Raises:
        ValueError: the message names the rule and the fixes.
    """
    if not _reentrant_checkpointing(model):
        return
    if not any(p.requires_grad for p in model.parameters()):
        return
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embeddings = get_embeddings() if callable(get_embeddings) else None
    if not isinstance(embeddings, nn.Module):
        return
    weight = getattr(embeddings, "weight", None)
    if (isinstance(weight, Tensor) and weight.requires_grad) or embeddings._forward_hooks:
        return
    raise ValueError(
        f"{type(model).__name__} uses reentrant activation checkpointing (use_reentrant=True), "
        "its input embeddings are frozen and nothing makes their output require a gradient, so "
        "the trainable parameters inside the checkpointed layers (LoRA adapters) would get no "
        "gradient. Use non-reentrant checkpointing (gradient_checkpointing_enable() with "
        "transformers' default use_reentrant=False, or SkrullFSDPStrategy("
        "activation_checkpointing=True)), or call model.enable_input_require_grads() after "
        "enabling it."
    )


def apply_lora(model: nn.Module, arguments: dict[str, Any]) -> nn.Module:
    """``peft.get_peft_model(model, LoraConfig(**arguments))`` for a causal LM.

    ``task_type`` defaults to ``"CAUSAL_LM"`` (the only one a causal LM trains with here).

    Raises:
        ImportError: peft is not installed (the message says how to install it).
        ValueError: another ``task_type``, or arguments ``LoraConfig`` does not take.
    """
    try:
        peft = importlib.import_module("peft")
    except ImportError as err:
        raise ImportError(
            f"a LoRA config was given, but peft is not installed: {PEFT_INSTALL_HINT}, or "
            "leave lora unset to train every weight."
        ) from err
    fields = {"task_type": "CAUSAL_LM", **arguments}
    if str(fields["task_type"]) not in ("CAUSAL_LM", "TaskType.CAUSAL_LM"):
        raise ValueError(
            f"lora task_type={fields['task_type']!r}: a causal LM trains with task_type "
            "'CAUSAL_LM'; leave it out (it is the default)."
        )
    try:
        config = peft.LoraConfig(**fields)
    except TypeError as err:
        raise ValueError(f"lora={arguments!r} is not a valid peft LoraConfig: {err}") from err
    return peft.get_peft_model(model, config)


def save_adapter(
    peft_model: nn.Module,
    hf_model: nn.Module,
    hf_state: dict[str, Tensor],
    directory: str | Path,
) -> None:
    """Write ``peft_model``'s adapter in peft's format from the wrapped model's full weights.

    ``hf_state`` is the full state dict of ``hf_model`` (keys relative to it, as a gathered
    FSDP state dict has them); the keys are put back under the ``PeftModel``'s prefix and
    ``PeftModel.save_pretrained(directory, state_dict=...)`` keeps the adapter's weights and
    writes ``adapter_config.json`` and ``adapter_model.safetensors``, loadable with
    ``PeftModel.from_pretrained(base_model, directory)``.
    """
    prefix = next(name for name, sub in peft_model.named_modules() if sub is hf_model)
    state = {f"{prefix}.{key}" if prefix else key: value for key, value in hf_state.items()}
    peft_model.save_pretrained(str(directory), state_dict=state)  # type: ignore[operator]


__all__ = [
    "PEFT_INSTALL_HINT",
    "apply_lora",
    "check_checkpointing_gradients",
    "find_peft_model",
    "save_adapter",
]
