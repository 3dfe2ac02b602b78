"""Gemma 3 under Skrull: the text model (``gemma3_text``, Gemma 3 1B) and the decoder of the
vision-language checkpoints (``gemma3``, 4B-27B, :mod:`~lightning_skrull.models.families.vision_language`).

Gemma 3's text model adds per-token pieces only (RMSNorms of q and k per head, a scaled
embedding, ``query_pre_attn_scalar`` as the softmax scale, a RoPE per layer kind) and
interleaves sliding and full layers, whose window it passes to the attention function. Two of
its options are not what the Skrull attention computes, and :func:`gemma3_problems` refuses them:
attention logit soft-capping and bidirectional attention. Its final logit soft-capping is the
chunked loss's to apply (:func:`~lightning_skrull.models.chunked_loss.final_logit_softcap`).
"""

from __future__ import annotations

from typing import Any

GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
"""``config.model_type`` of the Gemma 3 checkpoints :func:`gemma3_problems` applies to."""


def gemma3_problems(config: Any) -> list[str]:
    """Reasons a Gemma 3 text config cannot run exactly under the Skrull attention."""
    problems = []
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        problems.append(
            f"attn_logit_softcapping={softcap} (the Skrull attention has no soft-capping of the "
            "attention scores; Gemma 3 checkpoints set it to null)"
        )
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("use_bidirectional_attention=True (the Skrull attention is causal only)")
    return problems


__all__ = ["GEMMA3_MODEL_TYPES", "gemma3_problems"]
