"""The :class:`~lightning_skrull.scheduling.shapes.ModelShape` fields of a Hugging Face config.

Family by family (Qwen2/Llama-shaped dense decoders, the Mixture-of-Experts families of
:data:`MOE_MODEL_TYPES`, DeepSeek's Multi-head Latent Attention, sliding windows, the norms and
tied heads, the vision towers of :data:`VISION_LANGUAGE_MODEL_TYPES`), as
:meth:`~lightning_skrull.scheduling.shapes.ModelShape.from_hf_config` reads them. Plain
attribute reads: no transformers import.
"""

from __future__ import annotations

from typing import Any

MOE_MODEL_TYPES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "deepseek_v3",
    "glm4_moe",
    "deepseek_v2",
    "gpt_oss",
)
"""Hugging Face ``model_type``s whose sparse MLP
:meth:`~lightning_skrull.scheduling.shapes.ModelShape.from_hf_config` reads."""

MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
"""Hugging Face ``model_type``s with Multi-head Latent Attention (:class:`ModelShape`)."""

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
"""Config fields that mark a Mixture-of-Experts model in the families transformers ships."""

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
:meth:`~lightning_skrull.scheduling.shapes.ModelShape.from_hf_config` reads
(``lightning_skrull.models.families.vision_language``)."""


def decoder_fields(config: Any) -> dict[str, Any]:
    """The :class:`~lightning_skrull.scheduling.shapes.ModelShape` fields of a Hugging Face
    decoder config (the text decoder of a vision-language one: its ``text_config``).

    Raises:
        ValueError: when the config lacks a needed field, or has experts of a family not
            listed (its count would silently be a dense one).
    """
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
    return dict(
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


def vision_parameters(config: Any) -> tuple[int, int]:
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
