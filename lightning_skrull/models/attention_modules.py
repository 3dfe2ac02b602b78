"""The text decoder's attention modules, and what their forward passes to the attention function.

:func:`~lightning_skrull.models.check_model` reads the allow-listed attentions' source instead
of trusting their names: every ``self_attn`` module of the text decoder (not a vision tower's,
:func:`attention_modules`) must apply RoPE and then call the function registered with
transformers' ``AttentionInterface`` (:func:`attention_path_problems`), and a sliding window
counts as applied only where each layer passes it to that function
(:func:`unpassed_window`; :func:`passes_to_attention` reads one keyword argument of the call).
"""

from __future__ import annotations

import inspect

from torch import nn

from lightning_skrull.models.families.mla import ROPE_CALLS as MLA_ROPE_CALLS
from lightning_skrull.models.families.vision_language import language_model, text_config

_INTERFACE_CALL = "ALL_ATTENTION_FUNCTIONS.get_interface("
ROPE_CALLS = ("apply_rotary_pos_emb(", *MLA_ROPE_CALLS)
"""The rotary calls of the allow-listed attentions (DeepSeek-V2's is ``apply_rotary_emb``,
:mod:`~lightning_skrull.models.families.mla`)."""
WINDOW_ARGUMENT = "sliding_window="


def attention_window(model: nn.Module) -> int | None:
    """The sliding attention window the model applies, or ``None`` for full causal attention.

    Qwen2 / Qwen3 apply ``config.sliding_window`` to the layers that ``config.layer_types``
    marks ``"sliding_attention"`` (only when ``use_sliding_window=True``); Mistral applies
    ``config.sliding_window`` to every layer whenever it is set (its configs default to 4096).
    A window at least as long as a sequence changes nothing for that sequence. A
    vision-language model's is its text model's (``config.text_config``).
    """
    config = text_config(getattr(model, "config", None))
    window = getattr(config, "sliding_window", None)
    if not window:  # Qwen2-MoE's config sets 0 for "no window"
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def passes_to_attention(cls: type, argument: str) -> bool:
    """Whether ``cls.forward`` passes ``argument`` (``"sliding_window="``, ``"s_aux="``) to its
    attention function call."""
    try:
        source = inspect.getsource(cls.forward)  # type: ignore[attr-defined]
    except (OSError, TypeError):
        return False
    call = source.find("attention_interface(")
    return call >= 0 and source.find(argument, call) >= 0


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The ``self_attn`` modules of the text decoder (not a vision tower's)."""
    layers: list[nn.Module] = []
    for module in language_model(model).modules():
        attn = getattr(module, "self_attn", None)
        if isinstance(attn, nn.Module):
            layers.append(attn)
    return layers


def unpassed_window(model: nn.Module) -> int | None:
    """The model's sliding window when some attention module does not pass it to the attention
    function, else ``None``.

    The Skrull attention applies the window each layer passes as ``sliding_window`` (as
    transformers' FlashAttention integration does). A model whose window lives only in the
    mask it builds, like Qwen2-MoE (its attention keeps ``self.sliding_window`` but passes
    nothing), would silently get full attention, so its window still limits the sequences
    (:func:`~lightning_skrull.models.checks.sequence_length_rule`).
    """
    window = attention_window(model)
    if window is None:
        return None
    if all(passes_to_attention(type(attn), WINDOW_ARGUMENT) for attn in attention_modules(model)):
        return None
    return window


def attention_path_problems(model: nn.Module) -> list[str]:
    """Reasons why the attention modules do not go through the AttentionInterface."""
    problems: list[str] = []
    attns = attention_modules(model)
    num_layers = getattr(text_config(model.config), "num_hidden_layers", None)
    if not attns:
        return ["no decoder layer with a `self_attn` module was found"]
    if num_layers is not None and len(attns) != num_layers:
        problems.append(
            f"found {len(attns)} `self_attn` modules for num_hidden_layers={num_layers}"
        )
    for cls in sorted({type(a) for a in attns}, key=lambda c: c.__qualname__):
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            problems.append(f"the source of {cls.__qualname__}.forward cannot be inspected")
            continue
        call = source.find("attention_interface(")
        if _INTERFACE_CALL not in source or call < 0:
            problems.append(
                f"{cls.__qualname__}.forward does not call the attention through transformers' "
                "AttentionInterface (ALL_ATTENTION_FUNCTIONS.get_interface)"
            )
        elif not any(0 <= source.find(rope) < call for rope in ROPE_CALLS):
            problems.append(
                f"{cls.__qualname__}.forward does not apply RoPE (apply_rotary_pos_emb) before "
                "the attention call"
            )
    return problems
