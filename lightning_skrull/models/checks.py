"""Which Hugging Face decoders Skrull trains exactly, and the checks that refuse the others.

:func:`check_model` accepts a model only when its result under Skrull equals its result on one
process:

- a decoder-only causal LM of an allow-listed architecture (:data:`SUPPORTED_ARCHITECTURES`);
- every decoder layer's attention applies RoPE (from ``position_ids``) and then calls the
  function registered with the ``AttentionInterface``
  (:func:`~lightning_skrull.models.attention_modules.attention_path_problems`);
- causal, and without attention dropout;
- a sliding window only where each layer passes it to the attention function (the
  ``sliding_window`` keyword, which the Skrull attention applies; Qwen2-MoE does not, so its
  window still limits the sequence length,
  :func:`~lightning_skrull.models.attention_modules.unpassed_window`);
- a RoPE whose frequencies depend on the config only, or on the batch only beyond a length no
  sequence reaches (:mod:`lightning_skrull.models.rope`);
- the rules of its family (:mod:`lightning_skrull.models.families`): for a Mixture-of-Experts
  model a deterministic router, no router auxiliary loss and trainable experts
  (:mod:`~lightning_skrull.models.families.moe`); for a vision-language checkpoint its family's
  text model (:mod:`~lightning_skrull.models.families.vision_language`); for Gemma 3 no attention
  soft-capping nor bidirectional attention (:mod:`~lightning_skrull.models.families.gemma3`).

Anything else raises ``ValueError`` naming the model class and every reason at once.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import nn

from lightning_skrull.models.attention_modules import attention_path_problems, unpassed_window
from lightning_skrull.models.families.gemma3 import GEMMA3_MODEL_TYPES, gemma3_problems
from lightning_skrull.models.families.moe import quantized_expert_problems, router_problems
from lightning_skrull.models.families.vision_language import (
    is_multimodal,
    text_config,
    text_model_problems,
)
from lightning_skrull.models.rope import rope_length_limit, rope_problems

SUPPORTED_ARCHITECTURES: MappingProxyType[str, tuple[str, ...]] = MappingProxyType(
    {
        "qwen2": ("Qwen2ForCausalLM", "Qwen2Model"),
        "qwen3": ("Qwen3ForCausalLM", "Qwen3Model"),
        "llama": ("LlamaForCausalLM", "LlamaModel"),
        "mistral": ("MistralForCausalLM", "MistralModel"),
        "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeModel"),
        "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeModel"),
        "mixtral": ("MixtralForCausalLM", "MixtralModel"),
        "gemma3_text": ("Gemma3ForCausalLM", "Gemma3TextModel"),
        "gemma3": ("Gemma3ForConditionalGeneration",),
        "mistral3": ("Mistral3ForConditionalGeneration",),
        "olmo2": ("Olmo2ForCausalLM", "Olmo2Model"),
        "olmo3": ("Olmo3ForCausalLM", "Olmo3Model"),
        "phi3": ("Phi3ForCausalLM", "Phi3Model"),
        "glm4": ("Glm4ForCausalLM", "Glm4Model"),
        "smollm3": ("SmolLM3ForCausalLM", "SmolLM3Model"),
        "granite": ("GraniteForCausalLM", "GraniteModel"),
        "ministral": ("MinistralForCausalLM", "MinistralModel"),
        "seed_oss": ("SeedOssForCausalLM", "SeedOssModel"),
        "exaone4": ("Exaone4ForCausalLM", "Exaone4Model"),
        "deepseek_v3": ("DeepseekV3ForCausalLM", "DeepseekV3Model"),
        "glm4_moe": ("Glm4MoeForCausalLM", "Glm4MoeModel"),
        "deepseek_v2": ("DeepseekV2ForCausalLM", "DeepseekV2Model"),
        "gpt_oss": ("GptOssForCausalLM", "GptOssModel"),
    }
)
"""``config.model_type`` -> model classes (or their subclasses) that Skrull runs exactly.

Qwen2.5 checkpoints use ``model_type="qwen2"``. Each of these applies RoPE to queries and keys
and then calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``, with
no other sequence mixing, so packing sequences and sharding them over ranks changes nothing
as long as the attention function honours the layout.

The families beyond the dense decoders keep that true, each for its own reasons, in
:mod:`lightning_skrull.models.families`: the Mixture-of-Experts ones (``qwen3_moe``,
``qwen2_moe``, ``mixtral``, ``deepseek_v3``, ``glm4_moe``, ``deepseek_v2``, ``gpt_oss``) route
and compute each token alone (:mod:`~lightning_skrull.models.families.moe`); DeepSeek's
Multi-head Latent Attention passes values narrower than the keys
(:mod:`~lightning_skrull.models.families.mla`); gpt-oss adds attention sinks
(:mod:`~lightning_skrull.models.families.sinks`) and alternates sliding (128-token) and full
layers, whose window it passes; Gemma 3's text model (``gemma3_text``) interleaves sliding and
full layers (:mod:`~lightning_skrull.models.families.gemma3`); Gemma 3's 4B, 12B and 27B
checkpoints (``gemma3``) and Mistral Small 3.1 / 3.2 (``mistral3``) hold such a text model beside
a vision tower and train on text only (:mod:`~lightning_skrull.models.families.vision_language`).
"""


def sequence_length_limit(model: nn.Module) -> int | None:
    """Longest sequence the prepared model runs exactly under Skrull (``None``: no limit).

    A model with a sliding window ``W`` that its layers do not pass to the attention function
    (:func:`~lightning_skrull.models.attention_modules.unpassed_window`) gives the same result only for sequences of at most ``W`` tokens.
    A ``"dynamic"`` or ``"longrope"`` RoPE keeps the frequencies one process uses only up to
    its threshold length (:func:`~lightning_skrull.models.rope.rope_length_limit`). The engine
    checks every global batch against the smaller limit.
    """
    rule = sequence_length_rule(model)
    return None if rule is None else rule[0]


def sequence_length_rule(model: nn.Module) -> tuple[int, str] | None:
    """``(limit, what sets it)`` of :func:`sequence_length_limit`, or ``None`` without a limit.

    ``what sets it`` completes "more than ...": the sliding window, or the RoPE threshold.
    """
    name = type(model).__name__
    rules: list[tuple[int, str]] = []
    window = unpassed_window(model)
    if window is not None:
        rules.append(
            (
                window,
                f"the {window}-token sliding attention window of {name}, which its layers do not "
                "pass to the attention function, so the Skrull attention would attend beyond it",
            )
        )
    rope = rope_length_limit(model)
    if rope is not None:
        rope_type, limit = rope
        rules.append(
            (
                limit,
                f"the {limit} tokens up to which the {rope_type!r} RoPE of {name} keeps its "
                "frequencies; beyond, they would depend on the other sequences of the rank",
            )
        )
    return min(rules, key=lambda rule: rule[0]) if rules else None


def check_model(model: nn.Module, *, max_sequence_length: int | None = None) -> None:
    """Check that Skrull runs ``model`` exactly; raise if not.

    Args:
        model: a Hugging Face ``PreTrainedModel``.
        max_sequence_length: longest sequence you will train on; only needed to accept a model
            with a sliding window its layers do not pass to the attention function (it must not
            exceed the window;
            :func:`~lightning_skrull.models.attention_modules.unpassed_window`) or a ``"dynamic"`` / ``"longrope"`` RoPE
            (it must not exceed the rope's threshold length).

    Raises:
        TypeError: ``model`` is not a transformers ``PreTrainedModel``.
        ValueError: the model is not supported; the message names the class and every reason.
    """
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"prepare_model expects a transformers PreTrainedModel (e.g. Qwen2ForCausalLM), got "
            f"{type(model).__name__}; pass the Hugging Face model itself (find_hf_model(module) "
            "finds it inside a LightningModule)."
        )
    config = model.config
    decoder = text_config(config)  # a vision-language model's text model reads its own
    field = "config.text_config" if is_multimodal(config) else "config"
    name = type(model).__name__
    reasons: list[str] = []
    model_type: str | None = getattr(config, "model_type", None)
    if getattr(config, "is_encoder_decoder", False):
        reasons.append(
            "it is an encoder-decoder model (only decoder-only causal LMs are supported)"
        )
    if not getattr(decoder, "is_causal", True):
        reasons.append(f"its {field} sets is_causal=False (bidirectional attention)")
    if model_type is None or model_type not in SUPPORTED_ARCHITECTURES:
        reasons.append(
            f"model_type {model_type!r} is not a supported architecture (supported: "
            f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
        )
    else:
        allowed = SUPPORTED_ARCHITECTURES[model_type]
        if not any(cls.__name__ in allowed for cls in type(model).__mro__):
            reasons.append(
                f"it is not a causal LM of its architecture (expected {' or '.join(allowed)} or "
                "a subclass)"
            )
        reasons.extend(attention_path_problems(model))
        reasons.extend(text_model_problems(config))
    dropout = float(getattr(decoder, "attention_dropout", 0.0) or 0.0)
    if dropout > 0.0:
        reasons.append(
            f"attention_dropout={dropout} (the Skrull attention has no dropout; set "
            f"{field}.attention_dropout=0.0)"
        )
    window = unpassed_window(model)
    if window is not None and (max_sequence_length is None or max_sequence_length > window):
        given = (
            "no max_sequence_length was given"
            if max_sequence_length is None
            else f"max_sequence_length={max_sequence_length} exceeds it"
        )
        reasons.append(
            f"it applies a sliding attention window of {window} tokens in the mask it builds but "
            "does not pass it to the attention function (no sliding_window= argument), so the "
            f"Skrull attention cannot apply it, and {given} (promise sequences no longer than "
            f"the window with prepare_model(..., max_sequence_length<={window}), or set "
            "config.use_sliding_window=False for full attention if the checkpoint was trained so)"
        )
    reasons.extend(rope_problems(model, max_sequence_length))
    reasons.extend(router_problems(model))
    reasons.extend(quantized_expert_problems(model))
    if model_type in GEMMA3_MODEL_TYPES:
        reasons.extend(gemma3_problems(decoder))
    if reasons:
        raise ValueError(
            f"{name} cannot be trained with Skrull context parallelism: " + "; ".join(reasons) + "."
        )
