"""Attention sinks (gpt-oss): a learned logit per query head that joins every query's softmax.

gpt-oss-20b / 120b (``gpt_oss``) give each attention layer a ``sinks`` parameter, one logit per
query head, which transformers' gpt-oss attention passes to the attention function as the
``s_aux`` keyword. It joins the softmax of every query of its head as a key whose value is
zero, so the output is the attention over the real keys times ``sigmoid(lse - sink_h)``: a rule
per query, which packing and sharding leave exact as long as every query sees the sink once.

The attention side holds only that generic mechanism, "a per-head sink logit":
:func:`~lightning_skrull.attention.dispatch.attention_sink` reads ``s_aux`` as ``[Hq]`` logits,
the ``sdpa`` backend adds them to each SDPA call as a key of its own
(:mod:`~lightning_skrull.attention.sdpa_calls`), and the ``flash`` backend, whose varlen kernels
have no sink term, refuses them (:func:`~lightning_skrull.attention.flash.refuse_sink`);
``"auto"`` runs the layers with sinks on ``sdpa``. Here: which models pass sinks
(:func:`has_attention_sinks`, read from their attention modules' source) and the refusal of an
explicit ``"flash"`` backend when the model is prepared (:func:`refuse_flash_backend`).
gpt-oss's router and its MXFP4-quantized experts are Mixture-of-Experts rules
(:mod:`~lightning_skrull.models.families.moe`); its sliding and full layers pass their window.
"""

from __future__ import annotations

from torch import nn

from lightning_skrull.attention.flash import SINK_FIX
from lightning_skrull.models.attention_modules import attention_modules, passes_to_attention

SINK_ARGUMENT = "s_aux="
"""The keyword that passes a layer's sink logits to the attention function."""


def has_attention_sinks(model: nn.Module) -> bool:
    """Whether some attention module of the text decoder passes attention sinks (``s_aux``,
    gpt-oss) to the attention function: the ``flash`` backend cannot run it."""
    return any(passes_to_attention(type(attn), SINK_ARGUMENT) for attn in attention_modules(model))


def refuse_flash_backend(model: nn.Module, backend: str) -> None:
    """Refuse the ``flash`` backend for a model with attention sinks (:func:`has_attention_sinks`).

    Raises:
        ValueError: ``backend == "flash"`` and the model passes sinks; the message names the
            model, the rule and the fix (:data:`~lightning_skrull.attention.flash.SINK_FIX`).
    """
    if backend == "flash" and has_attention_sinks(model):
        raise ValueError(
            f"attention backend 'flash' cannot train {type(model).__name__}: its attention "
            f"passes attention sinks (s_aux), which the varlen kernels have no term for; "
            f"{SINK_FIX}."
        )


__all__ = ["SINK_ARGUMENT", "has_attention_sinks", "refuse_flash_backend"]
