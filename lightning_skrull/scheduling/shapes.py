"""The shape of a decoder (what the FLOP count and the memory model need), and presets.

:class:`ModelShape` holds the widths, layer counts and per-family flags of a Qwen2-style
decoder (dense or Mixture-of-Experts, GQA or Multi-head Latent Attention, with or without a
sliding window) and counts its forward FLOPs per token and per (query, key) pair;
:meth:`ModelShape.from_hf_config` reads one from a Hugging Face config
(:mod:`~lightning_skrull.scheduling.hf_shapes`). The presets (:data:`QWEN2_5_0_5B`, the
default cost model's shape, to :data:`MIXTRAL_8X7B`) are the values of the published
``config.json`` files.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

from lightning_skrull.scheduling.hf_shapes import (
    VISION_LANGUAGE_MODEL_TYPES,
    decoder_fields,
    vision_parameters,
)
from lightning_skrull.scheduling.tiles import window_pairs


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """Shape of a Qwen2-style decoder (what the FLOP count and the memory model need).

    A Mixture-of-Experts decoder (Qwen3-MoE, Qwen2-MoE, Mixtral) replaces the MLP of
    ``sparse_layers`` of its layers by a router (``hidden_size x num_experts``), ``num_experts``
    SwiGLU experts of width ``expert_intermediate_size`` of which every token runs
    ``experts_per_token``, and optionally a shared SwiGLU expert every token runs, scaled by a
    sigmoid gate (``hidden_size x 1``; DeepSeek's and GLM-4-MoE's shared experts have none,
    ``shared_expert_gate=False``). The other layers keep the dense MLP of
    ``intermediate_size``. A dense decoder leaves the expert fields at 0.

    Multi-head Latent Attention (DeepSeek-V3 / V2, ``kv_lora_rank > 0``) replaces the q, k and v
    projections: q through ``h x q_lora_rank``, an RMSNorm and ``q_lora_rank x q_dim`` (or one
    ``h x q_dim`` without ``q_lora_rank``); k and v from one ``h x (kv_lora_rank +
    qk_rope_head_dim)`` projection whose latent part is normalised and expanded by
    ``kv_lora_rank x heads (head_dim - qk_rope_head_dim + v_head_dim)``, the rotary part shared
    by every head. ``head_dim`` is then the q/k head width (nope + rope), ``v_head_dim`` the
    value's, and every head has its own keys and values (``num_key_value_heads`` = heads).

    gpt-oss adds, all outside the FLOP count (no matmul) but in the parameters: an o_proj bias
    (``out_bias``), a sink logit per query head (``attention_sinks``), and biases on the router
    and on every expert's gate/up and down projections (``expert_bias``). Its experts compute a
    clamped GLU instead of SwiGLU (``clamped_glu``; the same matmuls, more kept activations).

    Attributes:
        hidden_size: model width ``h``.
        num_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA); equal to the query heads without GQA.
        head_dim: width of one head.
        intermediate_size: width of the dense SwiGLU MLP (the layers without experts).
        vocab_size: rows of the LM head.
        num_experts: routed experts of a sparse layer; 0 for a dense decoder.
        experts_per_token: experts each token runs in a sparse layer (top-k).
        expert_intermediate_size: width of one routed expert's SwiGLU MLP.
        shared_expert_intermediate_size: width of the shared expert (Qwen2-MoE); 0: none.
        sparse_layers: layers whose MLP is the sparse one; the others are dense.
        qkv_bias: the q, k and v projections have biases (Qwen2); parameters only.
        qk_norm: an RMSNorm of q and k (Qwen3, Gemma 3, OLMo 2 / 3, EXAONE 4); activation memory
            only.
        sliding_window: keys each query of a sliding layer sees, itself included; 0: none.
        sliding_layers: layers whose attention slides over ``sliding_window`` keys; the others
            attend the whole causal prefix.
        v_head_dim: width of one value head; 0: ``head_dim``.
        q_lora_rank: rank of MLA's query compression; 0: one q projection.
        kv_lora_rank: rank of MLA's key/value latent; 0: no MLA (k and v projections).
        qk_rope_head_dim: rotary part of MLA's q/k heads, its key shared by the heads.
        shared_expert_gate: the shared expert is scaled by a sigmoid gate (Qwen2-MoE).
        float32_router: the router computes in float32 whatever the model's dtype (DeepSeek,
            GLM-4-MoE); activation memory only.
        normalized_routing: the top-k routing weights are divided by their sum
            (``norm_topk_prob``; DeepSeek-V2 never does); activation memory only.
        out_bias: the o projection has a bias (gpt-oss); parameters only.
        attention_sinks: a learned sink logit per query head and layer (gpt-oss); parameters
            only.
        expert_bias: the router and each expert's projections have biases (gpt-oss);
            parameters only.
        clamped_glu: the experts' activation is gpt-oss's clamped GLU, and its router a
            softmax over the top-k logits only; activation memory only.
        tied_embeddings: the LM head is the input embedding (``tie_word_embeddings``: Gemma 3,
            small Qwen2.5); parameters only.
        layer_norms: RMSNorms over the hidden size in each decoder layer: 2 (before attention
            and MLP), 4 for Gemma 3 and GLM-4 (also after each), 2 for OLMo 2 / 3 and EXAONE 4
            (after each only).
        float32_norms: the RMSNorms apply their weight in float32 and keep that float32
            product (Gemma 3's ``(1 + w) x``, OLMo 2 / 3, gpt-oss); the others cast the
            normalised input to the compute dtype first. Activation memory only.
        qk_norm_over_heads: the q and k norms span all heads together (OLMo 2 / 3: weights of
            ``q_dim`` and ``kv_dim``) instead of one head (weights of ``head_dim``).
        fused_qkv: q, k and v come out of one projection (Phi-3), whose whole output stays
            alive as long as the attention keeps v (a view of it); activation memory only.
        layer_rope_width: width of the cos and sin each layer's RoPE builds for itself (GLM-4
            repeats the rotary half of a head's for its interleaved rotation); 0: the model's
            are shared by every layer. Activation memory only.
        vision_parameters: parameters outside the text decoder and the LM head (a
            vision-language checkpoint's vision tower and projector), which text-only training
            holds but never runs; parameters only.
        vision_root_parameters: those of ``vision_parameters`` outside the vision tower's
            blocks that FSDP2 shards as units of their own (``_no_split_modules``): they sit in
            the root unit, which FSDP2 gathers at every forward.
    """

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    sparse_layers: int = 0
    qkv_bias: bool = True
    qk_norm: bool = False
    sliding_window: int = 0
    sliding_layers: int = 0
    v_head_dim: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    shared_expert_gate: bool = True
    float32_router: bool = False
    normalized_routing: bool = True
    out_bias: bool = False
    attention_sinks: bool = False
    expert_bias: bool = False
    clamped_glu: bool = False
    tied_embeddings: bool = False
    layer_norms: int = 2
    float32_norms: bool = False
    qk_norm_over_heads: bool = False
    fused_qkv: bool = False
    layer_rope_width: int = 0
    vision_parameters: int = 0
    vision_root_parameters: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(f.default, bool):
                if not isinstance(value, bool):
                    raise ValueError(f"ModelShape.{f.name}={value!r} is invalid; give a bool.")
                continue
            least = 1 if f.default is MISSING else 0
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(
                    f"ModelShape.{f.name}={value!r} is invalid; give an int >= {least} "
                    "(read it from the model's config)."
                )
        moe = (
            self.experts_per_token,
            self.expert_intermediate_size,
            self.shared_expert_intermediate_size,
            self.sparse_layers,
        )
        if self.num_experts == 0 and any(moe):
            raise ValueError(
                f"ModelShape has num_experts=0 but expert fields {moe}; a dense decoder leaves "
                "experts_per_token, expert_intermediate_size, shared_expert_intermediate_size "
                "and sparse_layers at 0, a sparse one sets num_experts."
            )
        if self.num_experts:
            rules = (
                (1 <= self.experts_per_token <= self.num_experts, "1 <= experts_per_token <= num_experts"),
                (self.expert_intermediate_size >= 1, "expert_intermediate_size >= 1"),
                (1 <= self.sparse_layers <= self.num_layers, "1 <= sparse_layers <= num_layers"),
            )  # fmt: skip
            for ok, rule in rules:
                if not ok:
                    raise ValueError(
                        f"ModelShape with num_experts={self.num_experts}, experts_per_token="
                        f"{self.experts_per_token}, expert_intermediate_size="
                        f"{self.expert_intermediate_size}, sparse_layers={self.sparse_layers}, "
                        f"num_layers={self.num_layers} breaks {rule}; read them from the config."
                    )
        if bool(self.sliding_window) != bool(self.sliding_layers) or (
            self.sliding_layers > self.num_layers
        ):
            raise ValueError(
                f"ModelShape has sliding_window={self.sliding_window} and sliding_layers="
                f"{self.sliding_layers} of num_layers={self.num_layers}; a model without a "
                "window leaves both at 0, one with a window sets both (1 <= sliding_layers <= "
                "num_layers)."
            )
        if self.vision_root_parameters > self.vision_parameters:
            raise ValueError(
                f"ModelShape has vision_root_parameters={self.vision_root_parameters} > "
                f"vision_parameters={self.vision_parameters}; the root's are a part of them."
            )
        mla_ok = (
            self.num_key_value_heads == self.num_attention_heads
            and self.qk_rope_head_dim < self.head_dim
        )
        stray = (self.q_lora_rank or self.qk_rope_head_dim) and not self.kv_lora_rank
        if stray or (self.kv_lora_rank and not mla_ok):
            raise ValueError(
                f"ModelShape has kv_lora_rank={self.kv_lora_rank}, q_lora_rank={self.q_lora_rank}, "
                f"qk_rope_head_dim={self.qk_rope_head_dim}, head_dim={self.head_dim} and "
                f"{self.num_key_value_heads} of {self.num_attention_heads} heads for keys; "
                "Multi-head Latent Attention sets kv_lora_rank >= 1, qk_rope_head_dim < head_dim "
                "(head_dim = qk_nope_head_dim + qk_rope_head_dim) and a key per head, other "
                "attentions leave all three ranks at 0."
            )

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        """Shape of a Hugging Face decoder config: dense (Qwen2, Llama, Mistral, Qwen3 shape) or
        Mixture-of-Experts (``model_type`` in
        :data:`~lightning_skrull.scheduling.hf_shapes.MOE_MODEL_TYPES`).

        Dense fields: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``,
        ``intermediate_size`` and ``vocab_size``; ``num_key_value_heads`` and ``head_dim`` are
        optional (defaults: no GQA, ``hidden_size // num_attention_heads``). Qwen3-MoE and
        Qwen2-MoE: ``num_experts`` experts of ``moe_intermediate_size``,
        ``num_experts_per_tok`` per token, on the layers not in ``mlp_only_layers`` whose index
        + 1 is a multiple of ``decoder_sparse_step``; Qwen2-MoE adds its
        ``shared_expert_intermediate_size``. Mixtral: ``num_local_experts`` experts of
        ``intermediate_size`` on every layer. A set ``sliding_window`` (transformers' configs
        leave it ``None``, or Qwen2-MoE's 0, without ``use_sliding_window``) applies to the
        layers ``layer_types`` marks ``"sliding_attention"``, or to every layer without
        ``layer_types`` (Mistral, Mixtral, Qwen3-MoE). DeepSeek-V3, GLM-4-MoE and DeepSeek-V2:
        ``n_routed_experts`` experts of ``moe_intermediate_size``, ``num_experts_per_tok`` per
        token, on the layers from ``first_k_dense_replace`` on, and ``n_shared_experts`` shared
        ones of the same width as one ungated shared expert; DeepSeek's Multi-head Latent
        Attention from ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``,
        ``qk_rope_head_dim`` and ``v_head_dim``. gpt-oss: ``num_local_experts`` experts of
        ``intermediate_size`` on every layer, with biases, sinks and ``attention_bias`` on all
        four attention projections.

        Norms, fused projections, RoPE tables and the tied head by family (the fields are read
        in :mod:`~lightning_skrull.scheduling.hf_shapes`). A vision-language config
        (:data:`VISION_LANGUAGE_MODEL_TYPES`) gives its ``text_config``'s decoder, its own
        ``tie_word_embeddings`` (the one transformers ties by) and its vision tower and
        projector (:func:`~lightning_skrull.scheduling.hf_shapes.vision_parameters`).

        Raises:
            ValueError: when the config lacks a needed field, or has experts of a family not
                listed (its count would silently be a dense one).
        """
        if getattr(config, "model_type", None) in VISION_LANGUAGE_MODEL_TYPES:
            return _with_vision(cls.from_hf_config(config.text_config), config)
        return cls(**decoder_fields(config))

    @property
    def q_dim(self) -> int:
        """Width of all query heads together."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Width of all key heads together (of the value heads too unless ``v_head_dim``)."""
        return self.num_key_value_heads * self.head_dim

    @property
    def value_head_dim(self) -> int:
        """Width of one value head: ``v_head_dim``, or ``head_dim`` when it is 0."""
        return self.v_head_dim or self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of all value heads together."""
        return self.num_key_value_heads * self.value_head_dim

    @property
    def out_dim(self) -> int:
        """Width of the attention output, o_proj's input (every query head's value)."""
        return self.num_attention_heads * self.value_head_dim

    def attention_projection_flops_per_token(self) -> int:
        """Forward FLOPs per token of one layer's attention projections.

        q ``2*h*q_dim``, k ``2*h*kv_dim``, v ``2*h*v_dim``, o ``2*out_dim*h``. Multi-head
        Latent Attention instead: q ``2*h*q_lora_rank + 2*q_lora_rank*q_dim`` (``2*h*q_dim``
        without ``q_lora_rank``), the latent ``2*h*(kv_lora_rank + qk_rope_head_dim)``, its
        expansion ``2*kv_lora_rank*heads*(head_dim - qk_rope_head_dim + v_head_dim)``, o as
        above.
        """
        h = self.hidden_size
        out = 2 * self.out_dim * h
        if not self.kv_lora_rank:
            return 2 * h * (self.q_dim + self.kv_dim + self.v_dim) + out
        r_q, r_kv = self.q_lora_rank, self.kv_lora_rank
        q = 2 * h * r_q + 2 * r_q * self.q_dim if r_q else 2 * h * self.q_dim
        nope = self.head_dim - self.qk_rope_head_dim
        latent = 2 * h * (r_kv + self.qk_rope_head_dim)
        expand = 2 * r_kv * self.num_attention_heads * (nope + self.value_head_dim)
        return q + latent + expand + out

    @property
    def dense_layers(self) -> int:
        """Layers with the dense MLP (all of them for a dense decoder)."""
        return self.num_layers - self.sparse_layers

    def sparse_mlp_flops_per_token(self) -> int:
        """Forward FLOPs per token of one sparse layer's MLP (0 for a dense decoder).

        Router ``2*h*num_experts``; ``experts_per_token`` experts of three matmuls
        ``2*h*expert_ffn`` each; the shared expert's three ``2*h*shared_ffn`` and its gate
        ``2*h`` (``shared_expert_gate``). The routing itself (softmax or sigmoid, group and
        top-k selection, gathers, weighting) is not a matmul.
        """
        if not self.num_experts:
            return 0
        h = self.hidden_size
        routed = self.experts_per_token * 3 * 2 * h * self.expert_intermediate_size
        shared = self.shared_expert_intermediate_size
        gate = 2 * h if self.shared_expert_gate else 0
        shared_flops = 3 * 2 * h * shared + gate if shared else 0
        return 2 * h * self.num_experts + routed + shared_flops

    def linear_flops_per_token(self) -> int:
        """Forward FLOPs per token of every matmul that is not attention, all layers + LM head.

        Per layer: the attention projections (:meth:`attention_projection_flops_per_token`);
        the dense layers' SwiGLU MLP three matmuls ``2*h*ffn`` each, the sparse layers'
        :meth:`sparse_mlp_flops_per_token`. Once: LM head ``2*h*vocab``. Biases, norms,
        rotary embedding and the activation are ignored (well under 1% of the FLOPs).
        """
        h = self.hidden_size
        attention = self.attention_projection_flops_per_token()
        dense = 3 * 2 * h * self.intermediate_size
        return (
            self.num_layers * attention
            + self.dense_layers * dense
            + self.sparse_layers * self.sparse_mlp_flops_per_token()
            + 2 * h * self.vocab_size
        )

    @property
    def full_attention_layers(self) -> int:
        """Layers that attend the whole causal prefix (all of them without a window)."""
        return self.num_layers - self.sliding_layers

    def attention_flops_per_pair(self) -> int:
        """Forward FLOPs of one (query, key) pair, all heads, all full-attention layers (every
        layer of a model without a sliding window).

        ``Q K^T`` costs ``2 * head_dim`` per head, ``P V`` ``2 * value_head_dim``.
        """
        return self.full_attention_layers * 2 * (self.q_dim + self.out_dim)

    def sliding_attention_flops_per_pair(self) -> int:
        """Forward FLOPs of one (query, key) pair, all heads, all sliding-window layers (0
        without a window); the pairs are :func:`window_pairs`'."""
        return self.sliding_layers * 2 * (self.q_dim + self.out_dim)

    def forward_flops(self, length: int) -> int:
        """Exact forward FLOPs of one sequence of ``length`` tokens run whole (causal, no tiles).

        Causal attention computes ``length * (length + 1) / 2`` pairs (the diagonal included),
        a sliding layer :func:`window_pairs`.
        """
        pairs = length * (length + 1) // 2
        flops = length * self.linear_flops_per_token() + pairs * self.attention_flops_per_pair()
        if self.sliding_layers:
            windowed = window_pairs(length, self.sliding_window)
            flops += windowed * self.sliding_attention_flops_per_pair()
        return flops


def _with_vision(text: ModelShape, config: Any) -> ModelShape:
    """``text``, the shape of a vision-language ``config``'s decoder, with the config's own
    ``tie_word_embeddings`` (the one transformers ties by) and its vision parameters."""
    vision, root = vision_parameters(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return replace(
        text, tied_embeddings=tied, vision_parameters=vision, vision_root_parameters=root
    )


QWEN2_5_0_5B = ModelShape(
    hidden_size=896,
    num_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=4864,
    vocab_size=151936,
)
"""Shape of Qwen2.5-0.5B, the shape of the default cost model."""

QWEN2_5_7B = ModelShape(
    hidden_size=3584,
    num_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=18944,
    vocab_size=152064,
)
"""Shape of Qwen2.5-7B (``CostModel(shape=QWEN2_5_7B)``)."""

QWEN2_5_14B = ModelShape(
    hidden_size=5120,
    num_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=13824,
    vocab_size=152064,
)
"""Shape of Qwen2.5-14B."""

QWEN2_5_32B = ModelShape(
    hidden_size=5120,
    num_layers=64,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=27648,
    vocab_size=152064,
)
"""Shape of Qwen2.5-32B."""

QWEN2_5_72B = ModelShape(
    hidden_size=8192,
    num_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=29568,
    vocab_size=152064,
)
"""Shape of Qwen2.5-72B."""

QWEN3_30B_A3B = ModelShape(
    hidden_size=2048,
    num_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    intermediate_size=6144,
    vocab_size=151936,
    num_experts=128,
    experts_per_token=8,
    expert_intermediate_size=768,
    sparse_layers=48,
    qkv_bias=False,
    qk_norm=True,
)
"""Shape of Qwen3-30B-A3B (its config.json: ``moe_intermediate_size`` 768, 128 experts, 8 per
token, ``decoder_sparse_step`` 1, no ``mlp_only_layers``, no attention bias; ``head_dim`` 128,
not ``hidden_size / heads``): 30.5B parameters, 3.3B of them per token."""

MIXTRAL_8X7B = ModelShape(
    hidden_size=4096,
    num_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    vocab_size=32000,
    num_experts=8,
    experts_per_token=2,
    expert_intermediate_size=14336,
    sparse_layers=32,
    qkv_bias=False,
)
"""Shape of Mixtral-8x7B (its config.json: ``num_local_experts`` 8, 2 per token, experts of
``intermediate_size`` 14336): 46.7B parameters, 12.9B of them per token."""
