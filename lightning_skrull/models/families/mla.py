"""DeepSeek's Multi-head Latent Attention under Skrull: DeepSeek-V3 / R1, Kimi K2, Moonlight, DeepSeek-V2.

Multi-head Latent Attention (:data:`MLA_MODEL_TYPES`) builds each token's per-head keys and
values from a per-token latent (one ``hidden x (kv_lora_rank + qk_rope_head_dim)`` projection
whose latent part is normalised and expanded per head) and its queries from another latent
(``q_lora_rank``) or one projection. Only a part of each query and key head is rotated
(``qk_rope_head_dim``; the rotated key part is shared by the heads), and the values are narrower
than the queries and keys (DeepSeek-V3: keys 192 wide, values 128). Everything before the
attention call is per token, so packing sequences and sharding them over CP ranks changes
nothing, given an attention function that takes values of their own width.

The attention side holds that generic mechanism, "values narrower than the keys": the K/V
exchange carries both widths, and both backends return the values' width, padding them with
zero columns where a kernel takes one head dim
(:func:`~lightning_skrull.attention.schedule.pad_value`). What the checks of
:func:`~lightning_skrull.models.check_model` need to know of the family is here: DeepSeek-V2's
attention rotates with ``apply_rotary_emb`` (a complex multiplication), not
``apply_rotary_pos_emb`` (:data:`ROPE_CALLS`). The routers of DeepSeek-V3 and DeepSeek-V2 are
Mixture-of-Experts rules (:mod:`~lightning_skrull.models.families.moe`); what the cost model
counts for MLA lives with it (:mod:`lightning_skrull.scheduling.hf_shapes`).
"""

from __future__ import annotations

# ``config.model_type`` of the families with Multi-head Latent Attention, one list for the cost
# model and here
from lightning_skrull.scheduling.hf_shapes import MLA_MODEL_TYPES

ROPE_CALLS = ("apply_rotary_emb(",)
"""The rotary call of DeepSeek-V2's attention (``DeepseekV2Attention.forward``), which the check
that every attention applies RoPE before the attention call accepts beside
``apply_rotary_pos_emb``."""

__all__ = ["MLA_MODEL_TYPES", "ROPE_CALLS"]
