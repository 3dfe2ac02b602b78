"""Estimated time of a micro-batch on one CP group, from the model's shape and a few constants.

The model is deliberately simple and explicit, so that every number can be checked by hand:

* **Compute.** Forward FLOPs of a Qwen2-style decoder (GQA projections or DeepSeek's latent
  ones, SwiGLU MLP or the experts a token is routed to, causal attention, LM head); training costs ``train_flops_factor`` (3) times the forward; time is FLOPs
  divided by ``achieved_flops``.
* **Tiles.** Attention kernels work on ``tile_size`` x ``tile_size`` blocks of (query, key)
  pairs and compute every block that holds at least one unmasked pair. A short sequence, and
  even more a short sequence cut into ``2 * cp_size`` zigzag chunks, pays for padded blocks.
* **Sliding windows.** A layer with a window of ``W`` keys computes, for a sequence of ``s > W``
  tokens, ``W (W + 1) / 2 + (s - W) W`` pairs instead of ``s (s + 1) / 2``, and its kernel skips
  the key blocks before each query block's window (:func:`window_tiles`). The full-attention
  and the windowed layers are counted apart (``ModelShape.sliding_layers``); a model without a
  window gets exactly the full-attention numbers.
* **Communication.** A distributed sequence's K/V are all-gathered over the CP group in the
  forward and their gradients reduce-scattered in the backward: one collective per layer and
  direction, each ``comm_latency_s`` plus bytes over ``comm_bandwidth``.
* **Overhead.** A fixed ``micro_batch_overhead_s`` per micro-batch (launches, accumulation
  bookkeeping, data movement that does not scale with tokens), and a fixed
  ``per_sequence_seconds`` for every sequence a CP rank holds (a local sequence, or its chunks
  of a distributed one): the attention calls, views and autograd nodes a sequence costs beyond
  its arithmetic.

The time of CP rank ``j`` in a micro-batch is::

    overhead + linear(all tokens on j) + per_sequence * (sequences on j)
             + max(comm, local_attention(j)) + distributed_attention

The attention of the local sequences overlaps the K/V communication (the paper's Eq. 2): the
projections run before the all-gather can start and the MLP after the attention ends.

A plan may cut the distributed sequences into K/V groups (``MicroBatchPlan.kv_groups``), each
exchanged by its own collectives, all started together: group ``g + 1``'s exchange then also
runs while group ``g``'s distributed attention computes. With groups ``1..G`` of communication
``c_g`` (each paying the latency) and distributed attention ``d_g``, the attention part of rank
``j`` becomes ``max(local_attention(j) + D, K)`` with ``D = sum(d)`` and
``K = max over g of (c_1 + ... + c_g) + (d_g + ... + d_G)`` (:func:`kv_pipeline_span`), the
longest path of a two-stage pipeline; one group gives back the formula above.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, dataclass, fields, replace
from typing import Any

import numpy as np

from lightning_skrull.scheduling.plan import DISTRIBUTED, MicroBatchPlan

MOE_MODEL_TYPES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
    "deepseek_v2",
    "gpt_oss",
)
"""Hugging Face ``model_type``s whose sparse MLP :meth:`ModelShape.from_hf_config` reads."""

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
"""Hugging Face ``model_type``s with Multi-head Latent Attention (:class:`ModelShape`)."""

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that mark a Mixture-of-Experts model in the families transformers ships."""


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
        Mixture-of-Experts (``model_type`` in :data:`MOE_MODEL_TYPES`).

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

        Norms, fused projections, RoPE tables and the tied head by family (:func:`_layer_fields`).
        A vision-language config (:data:`VISION_LANGUAGE_MODEL_TYPES`) gives its
        ``text_config``'s decoder, its own ``tie_word_embeddings`` (the one transformers ties
        by) and its vision tower and projector (:func:`_vision_parameters`).

        Raises:
            ValueError: when the config lacks a needed field, or has experts of a family not
                listed (its count would silently be a dense one).
        """
        if getattr(config, "model_type", None) in VISION_LANGUAGE_MODEL_TYPES:
            return _with_vision(cls.from_hf_config(config.text_config), config)
        needed = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        )
        missing = [n for n in needed if getattr(config, n, None) is None]
        if missing:
            raise ValueError(
                f"{type(config).__name__} lacks {missing}; CostModel.from_hf_config needs a "
                "decoder config of Qwen2/Llama shape (or build ModelShape yourself)."
            )
        model_type = getattr(config, "model_type", None)
        layers = int(config.num_hidden_layers)
        heads = int(config.num_attention_heads)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        moe = _expert_fields(config, model_type, layers)
        mla = _mla_fields(config) if model_type in MLA_MODEL_TYPES else {}
        if mla:
            kv_heads = heads  # every head has its own keys and values
            head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        window, sliding = _sliding_window(config, layers)
        gpt_oss = model_type == "gpt_oss"
        biases = (getattr(config, "qkv_bias", False), getattr(config, "attention_bias", False))
        qkv_bias = model_type == "qwen2" or any(map(bool, biases))  # Qwen2's always
        return cls(
            hidden_size=int(config.hidden_size),
            num_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            vocab_size=int(config.vocab_size),
            qkv_bias=qkv_bias,
            qk_norm=model_type in _QK_NORM_MODEL_TYPES
            or (model_type == "glm4_moe" and bool(getattr(config, "use_qk_norm", False))),
            sliding_window=window,
            sliding_layers=sliding,
            out_bias=gpt_oss and qkv_bias,
            attention_sinks=gpt_oss,
            **_layer_fields(config, model_type, int(head_dim)),
            **moe,
            **mla,
        )

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


_QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe", "gemma3_text", "olmo2", "olmo3", "exaone4")
"""Architectures that normalise q and k before RoPE (:attr:`ModelShape.qk_norm`)."""

_NORMS = {
    "gemma3_text": (4, True),
    "glm4": (4, False),
    "olmo2": (2, True),
    "olmo3": (2, True),
    "gpt_oss": (2, True),
}
"""``model_type`` -> (:attr:`ModelShape.layer_norms`, :attr:`ModelShape.float32_norms`) where
they are not ``(2, False)``."""

VISION_LANGUAGE_MODEL_TYPES = ("gemma3", "mistral3")
"""Vision-language ``model_type``s whose text decoder and vision parameters
:meth:`ModelShape.from_hf_config` reads (``lightning_skrull.models.multimodal``)."""


def _layer_fields(config: Any, model_type: str | None, head_dim: int) -> dict[str, Any]:
    """The :class:`ModelShape` fields of a family's norms, fused projections, RoPE tables and
    tied head."""
    norms, float32_norms = _NORMS.get(str(model_type), (2, False))
    return {
        "tied_embeddings": bool(getattr(config, "tie_word_embeddings", False)),
        "layer_norms": norms,
        "float32_norms": float32_norms,
        "qk_norm_over_heads": model_type in ("olmo2", "olmo3"),
        "fused_qkv": model_type == "phi3",
        "layer_rope_width": _rotary_width(config, head_dim) if model_type == "glm4" else 0,
    }


def _rotary_width(config: Any, head_dim: int) -> int:
    """The rotated part of a head: ``head_dim`` x ``partial_rotary_factor`` (in
    ``rope_parameters`` in transformers 5, on the config before)."""
    factor = getattr(config, "partial_rotary_factor", None)
    if factor is None:
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor")
    return int(head_dim * float(1.0 if factor is None else factor))


def _with_vision(text: ModelShape, config: Any) -> ModelShape:
    """``text``, the shape of a vision-language ``config``'s decoder, with the config's own
    ``tie_word_embeddings`` (the one transformers ties by) and its vision parameters."""
    vision, root = _vision_parameters(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    return replace(
        text, tied_embeddings=tied, vision_parameters=vision, vision_root_parameters=root
    )


def _vision_parameters(config: Any) -> tuple[int, int]:
    """:attr:`ModelShape.vision_parameters` and :attr:`ModelShape.vision_root_parameters` of a
    Gemma 3 or Mistral 3 config, counted from its ``vision_config`` (``h``, MLP ``f``, ``L``
    layers, ``c`` channels, patches of ``p``) and the text width ``t``.

    - Gemma 3, a SigLIP tower: the patch convolution with bias and a position embedding per
      patch (their own FSDP2 unit), ``L`` layers of two LayerNorms, four biased projections and
      a biased two-layer MLP, the final LayerNorm; the attention-pooling head where
      ``vision_use_head`` (its own unit); the projector's ``h x t`` weight and RMSNorm.
    - Mistral 3, a Pixtral tower: the patch convolution without bias and an RMSNorm, ``L``
      layers of two RMSNorms, four ``h x h`` projections and a SwiGLU MLP, no biases; the
      projector's RMSNorm, patch merger (``h s^2 x h``, ``s`` the ``spatial_merge_size``) and
      two linear layers (``h n x t`` for ``n`` feature layers, ``t x t``; biased where
      ``multimodal_projector_bias``).
    """
    vision = config.vision_config
    h, f = int(vision.hidden_size), int(vision.intermediate_size)
    layers, patch = int(vision.num_hidden_layers), int(vision.patch_size)
    conv = int(getattr(vision, "num_channels", 3)) * patch * patch * h
    t = int(config.text_config.hidden_size)
    if config.model_type == "gemma3":
        patches = (int(vision.image_size) // patch) ** 2
        embeddings = conv + h + patches * h
        mlp = 2 * h * f + f + h
        layer = 4 * h + 4 * (h * h + h) + mlp
        head = h + 4 * (h * h + h) + 2 * h + mlp if vision.vision_use_head else 0
        root = 2 * h + h * t + h  # the final LayerNorm, the projector
        return embeddings + layers * layer + head + root, root
    merge = int(config.spatial_merge_size)
    feature_layers = config.vision_feature_layer
    n = 1 if isinstance(feature_layers, int) else len(feature_layers)
    bias = bool(config.multimodal_projector_bias)
    layer = 2 * h + 4 * h * h + 3 * h * f
    root = conv + h + h + h * merge * merge * h + h * n * t + t * t + (2 * t if bias else 0)
    return layers * layer + root, root


def _expert_fields(config: Any, model_type: str | None, layers: int) -> dict[str, Any]:
    """The :class:`ModelShape` expert fields of a Hugging Face config (``{}``: dense).

    Raises:
        ValueError: experts of a Mixture-of-Experts family not read here.
    """
    moe: dict[str, Any] = {}
    if model_type in ("qwen3_moe", "qwen2_moe") and int(config.num_experts) > 0:
        dense_layers = set(getattr(config, "mlp_only_layers", None) or ())
        step = int(config.decoder_sparse_step)
        sparse = [i for i in range(layers) if i not in dense_layers and (i + 1) % step == 0]
        if sparse:
            moe = {
                "num_experts": int(config.num_experts),
                "experts_per_token": int(config.num_experts_per_tok),
                "expert_intermediate_size": int(config.moe_intermediate_size),
                "sparse_layers": len(sparse),
            }
            if model_type == "qwen2_moe":
                shared = int(getattr(config, "shared_expert_intermediate_size", None) or 0)
                moe["shared_expert_intermediate_size"] = shared
    elif model_type in ("deepseek_v3", "glm4_moe", "deepseek_v2"):
        first_dense = min(int(config.first_k_dense_replace or 0), layers)
        if layers > first_dense and int(config.n_routed_experts or 0) > 0:
            moe = {
                "num_experts": int(config.n_routed_experts),
                "experts_per_token": int(config.num_experts_per_tok),
                "expert_intermediate_size": int(config.moe_intermediate_size),
                "shared_expert_intermediate_size": int(config.moe_intermediate_size)
                * int(config.n_shared_experts or 0),
                "sparse_layers": layers - first_dense,
                "shared_expert_gate": False,
                "float32_router": True,
                "normalized_routing": model_type != "deepseek_v2"
                and bool(getattr(config, "norm_topk_prob", False)),
            }
    elif model_type in ("mixtral", "gpt_oss"):
        moe = {
            "num_experts": int(config.num_local_experts),
            "experts_per_token": int(config.num_experts_per_tok),
            "expert_intermediate_size": int(config.intermediate_size),
            "sparse_layers": layers,
        }
        if model_type == "gpt_oss":
            moe.update(expert_bias=True, clamped_glu=True)
    elif model_type not in MOE_MODEL_TYPES:
        experts = {n: getattr(config, n, None) for n in _EXPERT_FIELDS}
        experts = {n: v for n, v in experts.items() if v}
        if experts:
            raise ValueError(
                f"{type(config).__name__} (model_type={model_type!r}) has experts "
                f"{experts}, a Mixture-of-Experts family ModelShape.from_hf_config does not "
                f"read (it reads {MOE_MODEL_TYPES}); counting it as a dense MLP of "
                "intermediate_size would be wrong. Build ModelShape yourself with its "
                "num_experts, experts_per_token, expert_intermediate_size and sparse_layers."
            )
    return moe


def _mla_fields(config: Any) -> dict[str, Any]:
    """The :class:`ModelShape` fields of DeepSeek's Multi-head Latent Attention."""
    return {
        "v_head_dim": int(config.v_head_dim),
        "q_lora_rank": int(config.q_lora_rank or 0),
        "kv_lora_rank": int(config.kv_lora_rank),
        "qk_rope_head_dim": int(config.qk_rope_head_dim),
    }


def _sliding_window(config: Any, layers: int) -> tuple[int, int]:
    """``(window, sliding layers)`` of a Hugging Face config (``(0, 0)``: full attention)."""
    window = int(getattr(config, "sliding_window", None) or 0)
    layer_types = getattr(config, "layer_types", None)
    if not window:
        return 0, 0
    if layer_types is None:
        return window, layers
    sliding = sum(t == "sliding_attention" for t in layer_types[:layers])
    return (window, sliding) if sliding else (0, 0)


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


def kv_pipeline_span(comm: Sequence[float], attention: Sequence[float]) -> tuple[float, int]:
    """Longest path of the K/V pipeline, and the group on it.

    Group ``g``'s attention starts once its exchange (after the groups before it, one
    communication stream) and the previous group's attention are done, so the last attention
    ends at ``max over g of (comm[0] + ... + comm[g]) + (attention[g] + ... + attention[-1])``,
    measured from the first exchange's start (local attention left out; see
    :class:`CostModel`).

    Args:
        comm: seconds of each group's exchange, in order.
        attention: seconds of each group's distributed attention, same order.

    Returns:
        ``(span, g)``: the longest path and the first group ``g`` that reaches it; ``(0.0, 0)``
        for no groups.
    """
    total = sum(attention)
    best, arg = 0.0, 0
    sent = 0.0
    for g, (c, d) in enumerate(zip(comm, attention, strict=True)):
        sent += c
        if sent + total > best:
            best, arg = sent + total, g
        total -= d
    return best, arg


def causal_tiles(start: int, end: int, tile: int) -> int:
    """Blocks a tiled causal kernel computes for queries ``[start, end)`` of a sequence.

    Keys run from position 0. Query block ``u`` (``tile`` rows, the last one padded) covers
    positions up to ``min(start + (u + 1) * tile, end)`` and needs that many keys rounded up to
    whole key blocks. With ``tile == 1`` the result is the exact number of causal pairs.

    Args:
        start: first query position.
        end: one past the last query position (``end > start``).
        tile: block size of the kernel, in tokens.

    Returns:
        The number of ``tile x tile`` blocks computed.
    """
    nq = -(-(end - start) // tile)
    # Blocks u < nq - 1 end at start + (u + 1) * tile: ceil(start / tile) + u + 1 key blocks.
    return (nq - 1) * (-(-start // tile)) + (nq - 1) * nq // 2 + (-(-end // tile))


def window_pairs(length: int, window: int) -> int:
    """(query, key) pairs of a sequence under a sliding window of ``window`` keys.

    The query at position ``p`` sees keys ``[max(0, p - window + 1), p]``
    (transformers' ``sliding_window_causal_mask_function``): ``s (s + 1) / 2`` pairs for
    ``s <= window``, ``window (window + 1) / 2 + (s - window) window`` beyond.
    """
    if length <= window:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def window_tiles(start: int, end: int, tile: int, window: int) -> int:
    """Blocks a tiled sliding-window kernel computes for queries ``[start, end)`` of a sequence.

    As :func:`causal_tiles`, less the key blocks wholly before each query block's window: query
    block ``u`` starts at ``p = start + u * tile`` and needs no key block before the one holding
    ``p - window + 1``. With ``tile == 1`` the result is the exact number of pairs
    (:func:`window_pairs` for ``start == 0``).
    """
    full = causal_tiles(start, end, tile)
    nq = -(-(end - start) // tile)
    first = start - window + 1  # first key of query block u: first + u * tile, if positive
    u0 = 0 if first > 0 else -first // tile + 1  # the first block that skips a key block
    if u0 >= nq:
        return full
    n = nq - u0
    # key blocks skipped by block u >= u0: floor((first + u * tile) / tile) = first // tile + u
    return full - (n * (first // tile) + (u0 + nq - 1) * n // 2)


def zigzag_window_tiles(length: int, cp_size: int, tile: int, window: int) -> int:
    """:func:`window_tiles` summed over the non-empty zigzag chunks of :func:`zigzag_bounds`."""
    b = zigzag_bounds(length, cp_size)
    return sum(
        window_tiles(b[i], b[i + 1], tile, window) for i in range(2 * cp_size) if b[i + 1] > b[i]
    )


def zigzag_bounds(length: int, cp_size: int) -> list[int]:
    """Boundaries of the ``2 * cp_size`` zigzag chunks of a sequence (floor split, no padding).

    Chunk ``i`` is ``[b[i], b[i + 1])``; CP rank ``r`` holds chunks ``r`` and ``2N - 1 - r``.
    """
    n = 2 * cp_size
    return [i * length // n for i in range(n + 1)]


def floor_sum(n: int, m: int, a: int, b: int) -> int:
    """``sum(floor((a * i + b) / m) for i in range(n))`` in ``O(log m)`` (non-negative a, b)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b, m, a = y_max // m, y_max % m, a, m


@functools.lru_cache(maxsize=1 << 16)
def _residue_starts(m: int, tile: int, r: int) -> int:
    """``floor_sum(m, m * tile, r, (tile - 1) * m)``, cached: ``r < m * tile`` takes few values."""
    return floor_sum(m, m * tile, r, (tile - 1) * m)


def zigzag_tiles(length: int, cp_size: int, tile: int) -> int:
    """Blocks a tiled causal kernel computes for all ``2 * cp_size`` zigzag chunks of a sequence.

    Equal to ``sum(causal_tiles(b[i], b[i + 1], tile))`` over the non-empty chunks of
    :func:`zigzag_bounds`, in ``O(log)`` time when every chunk needs the same number of query
    blocks (the usual case), else by the plain sum.
    """
    m = 2 * cp_size
    q = length // m
    nq = -(-q // tile)
    if q == 0 or q % tile == 0:  # chunk lengths q and q + 1 need different query blocks
        b = zigzag_bounds(length, cp_size)
        return sum(causal_tiles(b[i], b[i + 1], tile) for i in range(m) if b[i + 1] > b[i])
    # sum over chunks of ceil(b_i / tile) for i < m; ceil(floor(i*s/m) / t) = floor((i*s + (t-1)*m) / (m*t)).
    # With s = k*m*t + r, each term is i*k plus a term that depends on r only (cached).
    k, r = divmod(length, m * tile)
    starts = k * (m - 1) * m // 2 + _residue_starts(m, tile, r)
    ends = starts + -(-length // tile)  # the same sum shifted by one chunk (b_0 = 0, b_m = s)
    return (nq - 1) * starts + m * (nq - 1) * nq // 2 + ends


def zigzag_tiles_many(lengths: Sequence[int], cp_size: int, tile: int) -> list[int]:
    """:func:`zigzag_tiles` of many lengths at once, vectorised; equal element by element.

    The closed form of :func:`zigzag_tiles` in integer numpy arithmetic (the residue sum
    taken directly over the ``2 * cp_size`` chunks); lengths its closed form does not cover
    go through :func:`zigzag_tiles` itself.
    """
    s = np.asarray(lengths, dtype=np.int64)
    m = 2 * cp_size
    q = s // m
    nq = -(-q // tile)
    k, r = np.divmod(s, m * tile)
    i = np.arange(m, dtype=np.int64)
    residue = ((r[:, None] * i[None, :] + (tile - 1) * m) // (m * tile)).sum(axis=1)
    starts = k * (m - 1) * m // 2 + residue
    ends = starts + -(-s // tile)
    out: list[int] = ((nq - 1) * starts + m * (nq - 1) * nq // 2 + ends).tolist()
    for j in np.flatnonzero((q == 0) | (q % tile == 0)).tolist():
        out[j] = zigzag_tiles(int(s[j]), cp_size, tile)
    return out


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Estimated seconds of micro-batches on one CP group. Every constant can be set or fitted.

    Attributes:
        shape: the decoder's shape (see :meth:`from_hf_config`).
        achieved_flops: FLOP/s one GPU achieves on this model's training kernels. Default: 40%
            of an H100 SXM's dense bf16 peak (989 TFLOP/s).
        micro_batch_overhead_s: fixed seconds per micro-batch, independent of its tokens.
        per_sequence_seconds: fixed seconds of each sequence a CP rank holds in a micro-batch
            (every local sequence on it, and every distributed sequence, whose chunks each rank
            holds), beyond its arithmetic. Default 0.0 (not measured yet); online calibration
            (:class:`~lightning_skrull.scheduling.OnlineCalibrator`) fits it.
        comm_latency_s: fixed seconds of one collective (one per layer and direction).
        comm_bandwidth: bytes per second one rank receives in a CP all-gather. Default: an
            NVLink-class intra-node figure (100 GB/s achieved).
        bytes_per_element: bytes of one K/V element (2 for bf16).
        tile_size: block size of the attention kernel, in tokens (128 for flash-attention on
            H100); 1 means exact pair counts.
        train_flops_factor: training FLOPs over forward FLOPs (forward + backward = 3x).
    """

    shape: ModelShape = QWEN2_5_0_5B
    achieved_flops: float = 0.4 * 989e12
    micro_batch_overhead_s: float = 2e-3
    per_sequence_seconds: float = 0.0
    comm_latency_s: float = 20e-6
    comm_bandwidth: float = 100e9
    bytes_per_element: int = 2
    tile_size: int = 128
    train_flops_factor: float = 3.0

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape):
            raise TypeError(
                f"CostModel.shape must be a ModelShape, got {type(self.shape).__name__}; "
                "build it with CostModel.from_hf_config(config)."
            )
        positive = ("achieved_flops", "comm_bandwidth", "train_flops_factor")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(
                    f"CostModel.{name}={value!r} is invalid; give a finite number > 0."
                )
        for name in ("micro_batch_overhead_s", "per_sequence_seconds", "comm_latency_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value >= 0 or math.isinf(value):
                raise ValueError(
                    f"CostModel.{name}={value!r} is invalid; give a finite number >= 0."
                )
        for name in ("bytes_per_element", "tile_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CostModel.{name}={value!r} is invalid; give an int >= 1.")

    @classmethod
    def from_hf_config(cls, config: Any, **constants: Any) -> CostModel:
        """Cost model of a Hugging Face decoder config: dense (Qwen2, Llama, Mistral, Qwen3
        shape) or Mixture-of-Experts (the ``model_type``s of :data:`MOE_MODEL_TYPES`).

        Args:
            config: a ``transformers`` config (or any object) with ``hidden_size``,
                ``num_hidden_layers``, ``num_attention_heads``, ``intermediate_size`` and
                ``vocab_size``; ``num_key_value_heads`` and ``head_dim`` are optional
                (defaults: no GQA, ``hidden_size // num_attention_heads``); the expert fields
                of the MoE families (:meth:`ModelShape.from_hf_config`).
            **constants: any other :class:`CostModel` field (``achieved_flops=...``).

        Returns:
            The cost model.

        Raises:
            ValueError: when the config lacks a needed field, or has experts of another family.
        """
        return cls(shape=ModelShape.from_hf_config(config), **constants)

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> CostModel:
        """The model ``dataclasses.asdict`` turned into ``values`` (its shape a nested dict),
        as checkpoints and YAML recipes hold it."""
        constants = dict(values)
        return cls(shape=ModelShape(**constants.pop("shape")), **constants)

    def with_constants(self, **constants: Any) -> CostModel:
        """A copy with some constants changed."""
        return replace(self, **constants)

    # ----------------------------------------------------------------- per-sequence terms
    def _seconds(self, forward_flops: float) -> float:
        return self.train_flops_factor * forward_flops / self.achieved_flops

    def linear_seconds(self, tokens: float) -> float:
        """Training seconds of the non-attention matmuls (and LM head) of ``tokens`` tokens."""
        return self._seconds(tokens * self.shape.linear_flops_per_token())

    def attention_pair_seconds(self) -> float:
        """Training seconds of one (query, key) pair of attention, all heads and full-attention
        layers (every layer without a sliding window)."""
        return self._seconds(self.shape.attention_flops_per_pair())

    def sliding_attention_pair_seconds(self) -> float:
        """Training seconds of one (query, key) pair, all heads and sliding-window layers."""
        return self._seconds(self.shape.sliding_attention_flops_per_pair())

    def local_attention_seconds(self, length: int) -> float:
        """Training seconds of the attention of a sequence kept whole on one rank (tiled)."""
        t = self.tile_size
        shape = self.shape
        flops = causal_tiles(0, length, t) * t * t * shape.attention_flops_per_pair()
        if shape.sliding_layers:
            tiles = window_tiles(0, length, t, shape.sliding_window)
            flops += tiles * t * t * shape.sliding_attention_flops_per_pair()
        return self._seconds(flops)

    def distributed_attention_seconds(self, length: int, cp_size: int) -> float:
        """Training seconds of a distributed sequence's attention on one CP rank (tiled).

        Each of the ``2 * cp_size`` zigzag chunks is a block of queries against the whole
        prefix of keys (a sliding layer: against the keys of its queries' windows); its query
        rows are padded up to ``tile_size``. The work is the mean over CP ranks (the zigzag
        layout balances it to within one block per chunk for full attention).
        """
        t = self.tile_size
        shape = self.shape
        tiles = zigzag_tiles(length, cp_size, t)
        flops = tiles * t * t * shape.attention_flops_per_pair() / cp_size
        if shape.sliding_layers:
            windowed = zigzag_window_tiles(length, cp_size, t, shape.sliding_window)
            flops += windowed * t * t * shape.sliding_attention_flops_per_pair() / cp_size
        return self._seconds(flops)

    def local_seconds(self, length: int) -> float:
        """Training seconds of a sequence kept whole on one rank (no communication), its fixed
        per-sequence cost included."""
        arithmetic = self.linear_seconds(length) + self.local_attention_seconds(length)
        return arithmetic + self.per_sequence_seconds

    def distributed_seconds(self, length: int, cp_size: int) -> float:
        """Training compute seconds of a distributed sequence on each CP rank, its fixed
        per-sequence cost included."""
        arithmetic = self.linear_seconds(length / cp_size) + self.distributed_attention_seconds(
            length, cp_size
        )
        return arithmetic + self.per_sequence_seconds

    def comm_bytes(self, distributed_tokens: int, cp_size: int) -> float:
        """Bytes one rank receives per micro-batch for distributed sequences of that many tokens.

        All layers, forward all-gather of K and V plus backward reduce-scatter of their
        gradients; each rank receives the ``(N - 1) / N`` it does not hold. Multi-head Latent
        Attention exchanges the per-head keys and values the attention function receives, not
        the latent.
        """
        if cp_size == 1:
            return 0.0
        per_token = (self.shape.kv_dim + self.shape.v_dim) * self.bytes_per_element  # K and V
        directions = 2 * self.shape.num_layers
        return directions * per_token * distributed_tokens * (cp_size - 1) / cp_size

    def num_collectives(self, cp_size: int) -> int:
        """Collectives per micro-batch with at least one distributed sequence."""
        return 0 if cp_size == 1 else 2 * self.shape.num_layers

    def comm_seconds(self, distributed_tokens: int, cp_size: int) -> float:
        """Seconds of the K/V communication of a micro-batch (0 with nothing distributed)."""
        if distributed_tokens == 0 or cp_size == 1:
            return 0.0
        return (
            self.num_collectives(cp_size) * self.comm_latency_s
            + self.comm_bytes(distributed_tokens, cp_size) / self.comm_bandwidth
        )

    # ----------------------------------------------------------------- micro-batch time
    def rank_seconds(self, mb: MicroBatchPlan, lengths: Sequence[int], cp_size: int) -> list[float]:
        """Estimated seconds of every CP rank of one micro-batch (overhead included)."""
        linear = [0.0] * cp_size
        attn = [0.0] * cp_size
        dist: list[int] = []
        per_sequence = self.per_sequence_seconds
        for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
            s = lengths[sid]
            if where == DISTRIBUTED:
                dist.append(s)
            else:
                linear[where] += self.linear_seconds(s) + per_sequence
                attn[where] += self.local_attention_seconds(s)
        dist_tokens = sum(dist)
        dist_attn = [self.distributed_attention_seconds(s, cp_size) for s in dist]
        dist_linear = self.linear_seconds(dist_tokens / cp_size) + per_sequence * len(dist)
        ranges = mb.kv_group_ranges()
        if len(ranges) > 1:
            span, _ = kv_pipeline_span(
                [self.comm_seconds(sum(dist[a:b]), cp_size) for a, b in ranges],
                [sum(dist_attn[a:b]) for a, b in ranges],
            )
            total = sum(dist_attn)
            base = self.micro_batch_overhead_s + dist_linear
            return [base + linear[j] + max(attn[j] + total, span) for j in range(cp_size)]
        comm = self.comm_seconds(dist_tokens, cp_size)
        base = self.micro_batch_overhead_s + dist_linear + sum(dist_attn)
        return [base + linear[j] + max(comm, attn[j]) for j in range(cp_size)]

    def micro_batch_seconds(
        self, mb: MicroBatchPlan, lengths: Sequence[int], cp_size: int
    ) -> float:
        """Estimated seconds of one micro-batch: its slowest CP rank."""
        return max(self.rank_seconds(mb, lengths, cp_size))
