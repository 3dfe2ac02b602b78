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
  ``vocab_size``); the model's own config for a text-only model. The text model must be the
  family's (:func:`text_model_problems`).
- :func:`language_model`: the decoder whose layers run the Skrull attention.
- :func:`text_only_unused_parameters`: the vision tower's and projector's parameters, which
  :class:`~lightning_skrull.SkrullStrategy` leaves out of DDP's gradient reduction (DDP would
  otherwise wait for their gradients and fail); FSDP2 and ZeRO-2 reduce the gradients that
  exist and need nothing.
- :func:`refuse_images`: a forward pre-hook that :func:`~lightning_skrull.models.prepare_model`
  adds to a vision-language model; while it runs the Skrull attention, a forward given
  ``pixel_values``, image features or ``token_type_ids`` is refused (the images' bidirectional
  attention and the vision tower are not what the Skrull attention computes). It reads no
  tensor's values, so it costs no device sync.
- :func:`refuse_image_token`: the image token in ``input_ids`` (a placeholder for image
  features), refused on the host: ``SkrullDataModule`` checks every sample at setup, and the
  Skrull strategies check each batch before it moves to the device.
"""

from __future__ import annotations

import functools
import inspect
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


def text_model_problems(config: Any) -> list[str]:
    """The reason a vision-language ``config``'s text model is not its family's
    (:data:`MULTIMODAL_MODEL_TYPES`: ``gemma3_text`` in ``gemma3``, ``mistral`` in ``mistral3``);
    empty when it is, or for a text model."""
    if not is_multimodal(config):
        return []
    model_type = config.model_type
    text_type = getattr(text_config(config), "model_type", None)
    if text_type == MULTIMODAL_MODEL_TYPES[model_type]:
        return []
    return [
        f"its text model's model_type is {text_type!r}, not the "
        f"{MULTIMODAL_MODEL_TYPES[model_type]!r} that {model_type!r} checkpoints hold"
    ]


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


@functools.cache
def _positions(forward: Any) -> dict[str, int]:
    """Positional index (``self`` not counted) of each parameter of a ``forward`` function."""
    names = list(inspect.signature(forward).parameters)[1:]
    return {name: i for i, name in enumerate(names)}


def _argument(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    """``module``'s forward argument ``name`` (keyword, or positional where its forward takes
    it: ``token_type_ids`` is the sixth of Gemma 3's, Mistral 3's has none), or ``None``."""
    if name in kwargs:
        return kwargs[name]
    position = _positions(type(module).forward).get(name)
    return args[position] if position is not None and len(args) > position else None


def refuse_images(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Forward pre-hook of a vision-language model: refuse images under the Skrull attention.

    Under another attention (switched back to generate,
    :func:`~lightning_skrull.models.plain_attention`) every call passes. It looks at which
    arguments are given, never at a tensor's values, so it costs no device sync: the image
    token in ``input_ids`` is refused on the host, by ``SkrullDataModule`` at setup (every
    sample) and by the Skrull strategies before each batch moves to the device
    (:func:`refuse_image_token`).

    Raises:
        ValueError: ``pixel_values``, ``mm_encoder_outputs`` or ``token_type_ids`` given (the
            latter mark image tokens; text-only training has none, and all-zero
            ``token_type_ids`` equal none); the message names the value and the fix
            (:data:`TEXT_ONLY_FIX`).
    """
    config = getattr(module, "config", None)
    if getattr(text_config(config), "_attn_implementation", None) != ATTENTION_NAME:
        return
    name = type(module).__name__
    pixels = _argument(module, args, kwargs, "pixel_values")
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
    types = _argument(module, args, kwargs, "token_type_ids")
    if types is not None:
        shape = tuple(types.shape) if isinstance(types, torch.Tensor) else type(types).__name__
        raise ValueError(
            f"{name} got token_type_ids ({shape}) under the Skrull attention. They mark image "
            "tokens (1 = image), which text-only training has none of; all zeros equal passing "
            f"none, so drop them. {TEXT_ONLY_FIX}"
        )


def refuse_image_token(input_ids: torch.Tensor, config: Any, where: str) -> None:
    """Refuse ``input_ids`` holding ``config``'s image token (:func:`image_token_id`), a
    placeholder for image features, when the model is a vision-language one trained on text.

    The Skrull strategies call it on each micro-batch of a batch while it is still on the host
    (before Lightning moves it to the device), so the check reads no device tensor.

    Args:
        input_ids: token ids, any shape.
        config: the model's config (a text model's passes: it has no image token).
        where: what ``input_ids`` belong to, for the message (``"micro-batch 2"``).

    Raises:
        ValueError: the image token is in ``input_ids``; the message names its first position,
            how often it occurs and the fix (:data:`TEXT_ONLY_FIX`).
    """
    image = image_token_id(config) if is_multimodal(config) else None
    if image is None:
        return
    found = input_ids == image
    if not bool(found.any()):
        return
    position = [int(i) for i in found.nonzero()[0]]
    raise ValueError(
        f"{where}: input_ids{position} = {image} is the model's image token, a placeholder for "
        f"image features ({int(found.sum())} in it). {TEXT_ONLY_FIX}"
    )


__all__ = [
    "MULTIMODAL_MODEL_TYPES",
    "TEXT_ONLY_FIX",
    "image_token_id",
    "is_multimodal",
    "language_model",
    "refuse_image_token",
    "refuse_images",
    "text_config",
    "text_model_problems",
    "text_only_unused_parameters",
]
