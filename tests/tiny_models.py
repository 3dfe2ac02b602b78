"""The tiny models of the families whose tests need more than :func:`~helpers.tiny_model`.

- :func:`gpt_oss_model`: gpt-oss with attention sinks that matter;
- :func:`mla_model`: DeepSeek-V3 / GLM-4-MoE / DeepSeek-V2 with a random correction bias;
- :data:`VISION_LANGUAGE`: the vision-language checkpoints (Gemma 3, Mistral 3) trained on text.
"""

from __future__ import annotations

from typing import Any

import torch
from harness import routers
from helpers import tiny_config, tiny_model
from torch import nn

IMAGE_TOKEN = 67


def gpt_oss_model(seed: int = 4, **overrides: Any) -> nn.Module:
    """The tiny gpt-oss of tests/helpers.py with sinks of the scores' order (its initialiser
    draws them at std 0.02, where they would barely matter)."""
    model = tiny_model("gpt_oss", seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            sinks = layer.self_attn.sinks
            sinks.copy_(torch.randn(sinks.shape, generator=gen) * 2)
    return model


def mla_model(arch: str, *, seed: int = 4, **overrides: Any) -> nn.Module:
    """:func:`tiny_model` with a random ``e_score_correction_bias`` (as a trained checkpoint
    has; transformers initialises it to zeros), the same in every process. Its spread, 0.01, is
    of the order of the sigmoid scores' own at this initialisation: it changes some tokens'
    experts without deciding every token's. gpt-oss: :func:`gpt_oss_model`, whose
    sinks matter."""
    if arch == "gpt_oss":
        return gpt_oss_model(seed=seed, **overrides)
    model = tiny_model(arch, seed=seed, **overrides)
    gen = torch.Generator().manual_seed(seed + 1)
    for _, router in routers(model):
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.copy_(0.01 * torch.randn(bias.shape, generator=gen))
    return model


def _tiny_vision(**settings: Any) -> dict[str, Any]:
    """The tiny vision tower's settings (16-pixel images of 4-pixel patches), with ``settings``."""
    return {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 4,
        **settings,
    }


def tiny_gemma3(seed: int = 0, **text: Any) -> nn.Module:
    """A tiny random ``Gemma3ForConditionalGeneration`` in float32 with eager attention."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text_settings = tiny_config("gemma3_text", vocab_size=68, **text).to_dict()
    vision = _tiny_vision(vision_use_head=False)  # as Gemma 3's SigLIP
    config = Gemma3Config(
        text_config=text_settings,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=65,
        eoi_token_index=66,
        image_token_index=IMAGE_TOKEN,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).float()


def tiny_mistral3(seed: int = 0, **text: Any) -> nn.Module:
    """A tiny random ``Mistral3ForConditionalGeneration`` in float32 with eager attention."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    text_settings = tiny_config("mistral", vocab_size=68, **text).to_dict()
    vision = _tiny_vision(head_dim=8)
    config = Mistral3Config(
        text_config=text_settings,
        vision_config=vision,
        image_token_index=IMAGE_TOKEN,
        spatial_merge_size=2,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return Mistral3ForConditionalGeneration(config).float()


VISION_LANGUAGE = {"gemma3": tiny_gemma3, "mistral3": tiny_mistral3}
"""The vision-language tiny models by family: ``VISION_LANGUAGE[family](seed, **text)``."""
