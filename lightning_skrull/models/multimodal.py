"""Vision-language checkpoints fine-tuned on text only: Gemma 3 4B-27B, Mistral Small 3.1 / 3.2.

``AutoModelForCausalLM.from_pretrained("google/gemma-3-4b-it")`` returns a
``Gemma3ForConditionalGeneration`` (``model_type="gemma3"``): a SigLIP vision tower and a projector
(``model.model.vision_tower``, ``model.model.multi_modal_projector``) beside the Gemma 3 text
decoder (``model.model.language_model``, a ``Gemma3TextModel``), whose settings live in
``config.text_config``. Without images its forward is the text model's: embeddings, decoder
layers (sliding and full), ``lm_head``, and transformers' causal-LM loss. The vision tower and the
projector do not run, so their parameters get no gradient (and an optimizer leaves a parameter
without a gradient unchanged). Mistral Small 3.1 and 3.2 (24B) are the same shape:
``Mistral3ForConditionalGeneration`` (``model_type="mistral3"``), a Pixtral vision tower and a
projector beside a Mistral text decoder (``MistralModel``), which they run alone on text.

- :func:`text_config`: the config whose fields the package reads (heads, windows, RoPE,
  ``vocab_size``); the model's own config for a text-only model.
- :func:`language_model`: the decoder whose layers run the Skrull attention.
- :func:`text_only_unused_parameters`: the vision tower's and projector's parameters, which
  :class:`~lightning_skrull.SkrullStrategy` leaves out of DDP's gradient reduction (DDP would
  otherwise wait for their gradients and fail); FSDP2 and ZeRO-2 reduce the gradients that
  exist and need nothing.
- :func:`refuse_images`: a forward pre-hook that :func:`~lightning_skrull.models.prepare_model`
  adds to a vision-language model; while it runs the Skrull attention, a forward given
  ``pixel_values``, image features, ``token_type_ids`` marking image tokens or ``input_ids``
  holding the image token is refused (the images' bidirectional attention and the vision tower
  are not what the Skrull attention computes). ``SkrullDataModule`` refuses data holding the
  image token earlier, at setup (:func:`image_token_id`).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from lightning_skrull.attention.backends import ATTENTION_NAME

MULTIMODAL_MODEL_TYPES: MappingProxyType[str, str] = MappingProxyType(
    {"gemma3": "gemma3_text", "mistral3": "mistral"}
)
"""``config.model_type`` of a supported vision-language model -> ``model_type`` of its language
model (``config.text_config``), trained on text only."""

TEXT_ONLY_FIX = (
    "Skrull context parallelism trains vision-language checkpoints on text only. Strip the "
    "images from the data (no pixel_values, and no image placeholder tokens: a chat template "
    "given text-only messages writes none), or train the images without Skrull."
)
"""The rule and the fix named by every refusal of images (:func:`refuse_images`, and the data
check of ``SkrullDataModule``)."""


def is_multimodal(config: Any) -> bool:
    """Whether ``config`` is a supported vision-language model's (:data:`MULTIMODAL_MODEL_TYPES`)."""
    return getattr(config, "model_type", None) in MULTIMODAL_MODEL_TYPES


def text_config(config: Any) -> Any:
    """The config of the decoder that ``config``'s model trains: ``config.text_config`` for a
    vision-language model (:data:`MULTIMODAL_MODEL_TYPES`), else ``config`` itself."""
    return config.text_config if is_multimodal(config) else config


def language_model(model: nn.Module) -> nn.Module:
    """The text decoder of ``model``: ``model.model.language_model`` for a vision-language model,
    else ``model`` itself (every attention module in it is a decoder layer's)."""
    if not is_multimodal(getattr(model, "config", None)):
        return model
    inner = getattr(getattr(model, "model", None), "language_model", None)
    if not isinstance(inner, nn.Module):
        raise ValueError(
            f"{type(model).__name__} has no model.language_model text decoder; load the "
            "checkpoint with its transformers class (Gemma3ForConditionalGeneration, "
            "Mistral3ForConditionalGeneration)."
        )
    return inner


def text_only_unused_parameters(model: nn.Module) -> list[str]:
    """Names (relative to ``model``) of the trainable parameters text-only training never
    reaches: a vision-language model's outside its text decoder and ``lm_head`` (the vision
    tower, the projector); empty for a text model.

    DDP waits for a gradient of every trainable parameter it was given and fails at the next
    step when one never comes; the Skrull DDP strategy leaves these out of its gradient
    reduction (:func:`refuse_images` guarantees they get no gradient).
    """
    if not is_multimodal(getattr(model, "config", None)):
        return []
    reached = {id(p) for p in language_model(model).parameters()}
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        reached |= {id(p) for p in head.parameters()}
    return [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in reached]


def image_token_id(config: Any) -> int | None:
    """The token id that stands for image features in ``input_ids`` (``None``: none)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    return None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int) -> Any:
    """The forward's argument ``name`` (keyword, or positional at ``position``), or ``None``."""
    if name in kwargs:
        return kwargs[name]
    return args[position] if len(args) > position else None


def refuse_images(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a vision-language model: refuse images under the Skrull attention.

    Under another attention (switched back to generate,
    :func:`~lightning_skrull.models.plain_attention`) every call passes. The checks of
    ``token_type_ids`` and ``input_ids`` read one reduction of each back to the host per forward.

    Raises:
        ValueError: ``pixel_values`` or ``mm_encoder_outputs`` given, ``token_type_ids`` marking
            an image token, or the image token in ``input_ids``; the message names the value
            and the fix (:data:`TEXT_ONLY_FIX`).
    """
    config = getattr(module, "config", None)
    if getattr(text_config(config), "_attn_implementation", None) != ATTENTION_NAME:
        return
    name = type(module).__name__
    pixels = _argument(args, kwargs, "pixel_values", 1)
    if pixels is not None:
        shape = tuple(pixels.shape) if isinstance(pixels, torch.Tensor) else type(pixels).__name__
        raise ValueError(
            f"{name} got pixel_values ({shape}) under the Skrull attention. {TEXT_ONLY_FIX}"
        )
    if kwargs.get("mm_encoder_outputs") is not None:
        raise ValueError(
            f"{name} got mm_encoder_outputs (image features) under the Skrull attention. "
            f"{TEXT_ONLY_FIX}"
        )
    types = _argument(args, kwargs, "token_type_ids", 5)
    if isinstance(types, torch.Tensor) and bool((types != 0).any()):
        position = tuple(int(i) for i in (types != 0).nonzero()[0])
        raise ValueError(
            f"{name} got token_type_ids marking image tokens (token_type_ids{list(position)} = "
            f"{int(types[position])}, 1 = image) under the Skrull attention. {TEXT_ONLY_FIX}"
        )
    ids = _argument(args, kwargs, "input_ids", 0)
    image = image_token_id(config)
    if isinstance(ids, torch.Tensor) and image is not None and bool((ids == image).any()):
        count = int((ids == image).sum())
        raise ValueError(
            f"{name} got input_ids holding its image token (id {image}, {count} time(s)), a "
            f"placeholder for image features, under the Skrull attention. {TEXT_ONLY_FIX}"
        )


__all__ = [
    "MULTIMODAL_MODEL_TYPES",
    "TEXT_ONLY_FIX",
    "image_token_id",
    "is_multimodal",
    "language_model",
    "refuse_images",
    "text_config",
    "text_only_unused_parameters",
]
