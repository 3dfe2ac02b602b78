"""An analytical estimate of activation memory per token of a Hugging Face decoder step.

What autograd keeps per token for the backward of one training step (packed tokens, flash-style
attention without a score matrix, no activation checkpointing), from the model's config alone.
It explains the measured line of ``bucket_size="auto"`` (``alpha`` bytes per token) and says how
much of it the LM head takes with the dense loss and with the chunked one.

Per decoder layer, with ``b`` bytes per activation element (2 for bf16, 4 for float32), ``h``
the hidden size, ``h_kv`` the key/value width and ``f`` the MLP width:

- each RMSNorm keeps the float32 copy of its input (``4h``; in float32 the input itself), its
  float32 ``rsqrt`` (4 B) and the normalised input its weight multiplies (``b h``, or ``4h``
  where the weight is applied in float32: Gemma 3, OLMo 2 / 3, gpt-oss): ``(4 + b) h + 4``
  for each of the layer's norms (two; four in Gemma 3 and GLM-4, whose extra ones follow
  attention and MLP);
- the attention's and the MLP's input projections keep their input (``2 b h``: a pre-norm's
  output, or the residual stream where the norms follow the blocks, OLMo 2 / 3, EXAONE 4);
- attention keeps q (``b h``), k and v (``2 b h_kv``), its output (``b h``, also o_proj's
  input) and its float32 log-sum-exp per head (``4 x heads``); with Phi-3's fused q/k/v
  projection v is a view of it, which keeps the whole projection alive (``b (h + 2 h_kv)``
  instead of ``b h_kv``); GLM-4's RoPE builds its cos and sin in each layer (``2 b r``, ``r``
  the rotary width of a head);
- the SwiGLU MLP keeps the gate and up projections, the SiLU output and their product
  (``4 b f``; Gemma 3's GELU, Phi-3's and GLM-4's fused gate/up the same);
- the q and k norms (Qwen3, Gemma 3, EXAONE 4, GLM-4-MoE per head; OLMo 2 / 3 over all heads)
  keep, like the layer norms, a float32 copy and the normalised input: ``(4 + b)(h_q + h_kv)``,
  and a float32 ``rsqrt`` per head (per token over all heads).

Values narrower than the keys (``h_v``, the attention output ``h_o`` = heads x value head dim)
count at their own width: ``b (h_q + h_kv + h_v + h_o)``. DeepSeek's Multi-head Latent
Attention also keeps its two latent RMSNorms' float32 copies and normalised inputs,
``(4 + b)(r_q + r_kv)`` (``q_lora_rank``, ``kv_lora_rank``), their ``rsqrt`` and their outputs,
the inputs of ``q_b_proj`` and ``kv_b_proj`` (``b (r_q + r_kv)``); in float32 the kv norm's
float32 input is a view of ``kv_a_proj``'s whole output, which stays alive with the rotary part
of the keys beside the latent (``4 (r_kv + rope)``). Its queries and keys are
``heads x (nope + rope)`` wide, its keys and values per head.

A Mixture-of-Experts layer (Qwen3-MoE, Qwen2-MoE, Mixtral; ``E`` experts of width ``f_e``,
``k`` per token) keeps instead of the MLP, per token: the router's float32 probabilities
(``4E``), its top-k indices, weights and their sum (``12k + 4``); and for each of the ``k`` rows
a token is routed to, as transformers' default ``experts_implementation="grouped_mm"`` runs
them: the gathered input and the expert's output (``2 b h``), the gate/up output, SiLU output
and product (``4 b f_e``), the row's routing weight (at most 4 B) and three int64 permutation
indices (24 B). The ``"eager"`` loop over experts also keeps every weighted output (``b h`` more
per row, the input of its ``index_add_``) and two int64 indices instead of three. Qwen2-MoE's
shared expert adds a SwiGLU MLP (``4 b f_s``), its output and its sigmoid gate (``b h + b``);
DeepSeek's and GLM-4-MoE's shared experts keep the SwiGLU MLP only. DeepSeek-V3 and GLM-4-MoE
route with sigmoid scores (``4E`` kept, as the probabilities) and group-limited top-k, whose
group selection leaves nothing autograd keeps; their router computes in float32, so a 16-bit
model adds the float32 copy of its input (``4h``), and it saves the weights' sum only with
``norm_topk_prob`` (DeepSeek-V2 never normalises). gpt-oss's router softmaxes its top-k logits
only, keeping their probabilities (``b k``) and indices (``8k``); each of its rows keeps the
gathered input and output (``2 b h``), the gate/up output, the clamped gate, its sigmoid, the
GLU, ``up + 1`` and the product (``7 b f_e``, the clamped GLU) and its routing weight (``b``),
with four int64 indices under ``"grouped_mm"`` (the biases are gathered too) and, under
``"eager"``, the weighted output and two. Every routed row is computed, however the router
spreads the tokens, so none of this depends on the routing. The ``sdpa`` attention's copies of
q, k and v with the sink column (gpt-oss, :mod:`~lightning_skrull.attention.sdpa_calls`) are not
counted: like the score matrix, they belong to the kernel, not to the model. (They replace q,
k and v, one column wider per head on CPU; on CUDA the column is padded to a multiple of 8 and
a GQA call, which takes a causal bias, repeats K/V over the query heads.)

The head, dense (transformers' ``lm_head`` then ``ForCausalLMLoss``): the final norm
(``(4 + b) h + 4``, as a layer's) and its output, the head's input (``b h``); the logits (``b V``), their
float32 copy when ``b < 4`` (``4 V``), log-softmax's float32 output (``4 V``), and the float32
gradient of the logits in backward (``4 V``), all alive at the head's backward, when every layer's
activations still are. Chunked (:mod:`~lightning_skrull.models.chunked_loss`): the final norm
(``(4 + b) h + 4``) and the hidden states' gradient made in forward (``b h``); one chunk's logits are
a constant, not a per-token cost. With activation checkpointing each layer keeps only its input
(``b h``) and one layer's activations are alive again during its recomputation.

:func:`model_state_bytes` counts what a rank holds besides activations under each strategy
(parameters, gradients, optimizer states, and the transient copies each strategy makes), and
:func:`largest_bucket` turns the two into the largest ``bucket_size`` a device holds. The model
assumes what a user of a large model runs: bf16 compute with float32 master weights and AdamW
(two float32 moments), a step of several micro-batches (so the earlier micro-batches' gradients
are alive while the later ones run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal, get_args

from lightning_skrull.scheduling.shapes import (
    MIXTRAL_8X7B,
    QWEN2_5_7B,
    QWEN2_5_14B,
    QWEN2_5_32B,
    QWEN2_5_72B,
    QWEN3_30B_A3B,
    ModelShape,
)

ExpertsImplementation = Literal["grouped_mm", "eager"]
"""How transformers runs the experts (``config._experts_implementation``): ``"grouped_mm"``
(its default where the kernel exists) or ``"eager"``, a loop over the experts that got tokens."""


@dataclass(frozen=True)
class ActivationEstimate:
    """Estimated activation bytes per token of one training step.

    Attributes:
        layers: all decoder layers together.
        head: the final norm, the LM head and the loss.
    """

    layers: float
    head: float

    @property
    def total(self) -> float:
        """Bytes per token of the whole step."""
        return self.layers + self.head


def _shape(config: Any) -> ModelShape:
    """The shape of a config (a vision-language model's: its ``text_config``'s decoder and its
    vision parameters)."""
    if isinstance(config, ModelShape):
        return config
    return ModelShape.from_hf_config(config)


def _norm_b(shape: ModelShape, b: int) -> int:
    """Bytes per element of the normalised input a norm's weight multiplies."""
    return 4 if shape.float32_norms else b


def _norm_bytes(shape: ModelShape, b: int, width: int) -> int:
    """Bytes per token one RMSNorm of ``width`` keeps (module docstring)."""
    return (4 + _norm_b(shape, b)) * width + 4


def layer_bytes_per_token(
    shape: ModelShape,
    *,
    bytes_per_element: int = 2,
    experts_implementation: ExpertsImplementation = "grouped_mm",
) -> tuple[int, int]:
    """Activation bytes per token of one dense layer and of one sparse (MoE) layer of ``shape``
    (0 for the kind it does not have), as the module docstring counts them."""
    if experts_implementation not in get_args(ExpertsImplementation):
        raise ValueError(
            f"experts_implementation={experts_implementation!r} is not one of "
            f"{get_args(ExpertsImplementation)}."
        )
    b, h = bytes_per_element, shape.hidden_size
    q_width, kv_width = shape.q_dim, shape.kv_dim
    norms = shape.layer_norms * _norm_bytes(shape, b, h) + 2 * b * h
    v_width = q_width + kv_width + shape.v_dim if shape.fused_qkv else shape.v_dim
    attention = b * (q_width + kv_width + v_width + shape.out_dim)
    attention += 4 * shape.num_attention_heads + 2 * b * shape.layer_rope_width
    if shape.qk_norm:
        rows = (
            2 if shape.qk_norm_over_heads else shape.num_attention_heads + shape.num_key_value_heads
        )
        attention += (4 + _norm_b(shape, b)) * (q_width + kv_width) + 4 * rows
    r_q, r_kv = shape.q_lora_rank, shape.kv_lora_rank
    attention += (4 + 2 * b) * r_q + 4 if r_q else 0  # with its output, q_b_proj's input
    if r_kv:  # in float32 the norm's input is kv_a_proj's whole output (module docstring)
        attention += 4 * (r_kv + (shape.qk_rope_head_dim if b == 4 else 0)) + 2 * b * r_kv + 4
    dense = norms + attention + 4 * b * shape.intermediate_size if shape.dense_layers else 0
    if not shape.sparse_layers:
        return dense, 0
    k = shape.experts_per_token
    eager = experts_implementation == "eager"
    if shape.clamped_glu:  # gpt-oss (module docstring)
        router = b * k + 8 * k
        row = 2 * b * h + 7 * b * shape.expert_intermediate_size + b
        row += b * h + 16 if eager else 32
    else:
        router = 4 * shape.num_experts + 12 * k + (4 if shape.normalized_routing else 0)
        router += 4 * h if shape.float32_router and b < 4 else 0
        row = 2 * b * h + 4 * b * shape.expert_intermediate_size + 4
        row += b * h + 16 if eager else 24
    shared = shape.shared_expert_intermediate_size
    gate = b * h + b if shape.shared_expert_gate else 0
    shared_bytes = 4 * b * shared + gate if shared else 0
    return dense, norms + attention + router + k * row + shared_bytes


def activation_bytes_per_token(
    config: Any,
    *,
    chunked_loss: bool,
    bytes_per_element: int = 2,
    experts_implementation: ExpertsImplementation = "grouped_mm",
) -> ActivationEstimate:
    """Estimate activation bytes per token for a decoder with this Hugging Face ``config``.

    Args:
        config: a transformers config (dense, or Qwen3-MoE / Qwen2-MoE / Mixtral, or a
            vision-language model's, whose ``text_config`` is read; read by
            :meth:`~lightning_skrull.scheduling.shapes.ModelShape.from_hf_config`) or a
            :class:`~lightning_skrull.scheduling.shapes.ModelShape`.
        chunked_loss: the chunked LM head + cross-entropy instead of the dense logits.
        bytes_per_element: bytes of the compute dtype (2: bf16 / fp16, 4: float32).
        experts_implementation: how the experts of a MoE layer run (module docstring).

    Returns:
        The per-token estimate, split into layers and head.
    """
    shape = _shape(config)
    b = bytes_per_element
    dense, sparse = layer_bytes_per_token(
        shape, bytes_per_element=b, experts_implementation=experts_implementation
    )
    layers = shape.dense_layers * dense + shape.sparse_layers * sparse
    h, vocab = shape.hidden_size, shape.vocab_size
    final_norm = _norm_bytes(shape, b, h)
    if chunked_loss:
        head = final_norm + b * h
    else:
        logits = b * vocab + (4 * vocab if b < 4 else 0) + 4 * vocab + 4 * vocab
        head = final_norm + b * h + logits
    return ActivationEstimate(layers=float(layers), head=float(head))


def activation_bytes_per_token_checkpointed(
    config: Any, *, chunked_loss: bool, bytes_per_element: int = 2
) -> float:
    """Activation bytes per token with activation checkpointing of every decoder layer: each
    layer's input (``b h``), the largest layer's full activations (during its recomputation)
    and the head."""
    shape = _shape(config)
    full = activation_bytes_per_token(
        shape, chunked_loss=chunked_loss, bytes_per_element=bytes_per_element
    )
    inputs = shape.num_layers * bytes_per_element * shape.hidden_size
    largest = max(layer_bytes_per_token(shape, bytes_per_element=bytes_per_element))
    return float(inputs + largest + full.head)


# ----------------------------------------------------------------------------- model states
LARGE_MODELS = {
    "Qwen2.5-7B": QWEN2_5_7B,
    "Qwen2.5-14B": QWEN2_5_14B,
    "Qwen2.5-32B": QWEN2_5_32B,
    "Qwen2.5-72B": QWEN2_5_72B,
    "Qwen3-30B-A3B": QWEN3_30B_A3B,
    "Mixtral-8x7B": MIXTRAL_8X7B,
}
"""The shapes of the memory table in docs/strategies.md (untied heads)."""

MemoryStrategy = Literal["ddp", "zero2", "fsdp_cp", "fsdp_world"]
"""The strategies :func:`model_state_bytes` knows: ``SkrullStrategy`` (DDP),
``SkrullZero2Strategy``, ``SkrullFSDPStrategy(shard="cp")`` and ``(shard="world")``."""

MEMORY_STRATEGIES: tuple[str, ...] = get_args(MemoryStrategy)

DEEPSPEED_BUCKET_ELEMENTS = 2 * 200_000_000
"""ZeRO-2's reduce and all-gather buckets together, in elements (Lightning's defaults,
``reduce_bucket_size = allgather_bucket_size = 2e8``)."""


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a Qwen2-style decoder, dense or Mixture-of-Experts, and of what a
    vision-language checkpoint holds beside it.

    Attributes:
        per_layer: the largest decoder layer (projections, MLP or every expert and the router,
            norms): what FSDP2 gathers for the layer in flight.
        layers: all decoder layers.
        outside_layers: the embedding, the final norm and the LM head (unless tied).
        vision: the vision tower and projector (:attr:`ModelShape.vision_parameters`).
    """

    per_layer: int
    layers: int
    outside_layers: int
    vision: int = 0

    @property
    def text(self) -> int:
        """The parameters text-only training updates: the decoder and its head."""
        return self.layers + self.outside_layers

    @property
    def total(self) -> int:
        """Every parameter."""
        return self.text + self.vision


def _attention_parameters(shape: ModelShape) -> int:
    """Parameters of one layer's attention and its RMSNorms (see :func:`parameter_count`)."""
    h, q, kv = shape.hidden_size, shape.q_dim, shape.kv_dim
    norms = shape.layer_norms * h
    if not shape.kv_lora_rank:
        attention = h * (q + kv + shape.v_dim) + shape.out_dim * h + norms
        attention += (q + kv + shape.v_dim) if shape.qkv_bias else 0
        attention += (h if shape.out_bias else 0) + (
            shape.num_attention_heads if shape.attention_sinks else 0
        )
        if not shape.qk_norm:
            return attention
        return attention + (q + kv if shape.qk_norm_over_heads else 2 * shape.head_dim)
    r_q, r_kv, rope = shape.q_lora_rank, shape.kv_lora_rank, shape.qk_rope_head_dim
    nope = shape.head_dim - rope
    query = h * r_q + r_q + r_q * q if r_q else h * q
    latent = (
        h * (r_kv + rope) + r_kv + r_kv * shape.num_attention_heads * (nope + shape.value_head_dim)
    )
    bias = r_q + r_kv + rope + h if shape.qkv_bias else 0  # q_a, kv_a and o projections
    return query + latent + shape.out_dim * h + bias + norms


def parameter_count(shape: ModelShape, *, tied_head: bool | None = None) -> ParameterCount:
    """Parameters of a model of ``shape`` (``tied_head``: whether the LM head is the embedding;
    ``None``: ``shape.tied_embeddings``): ``shape.layer_norms`` RMSNorms per layer, q/k/v
    biases where ``shape.qkv_bias`` (the attention biases of Multi-head Latent Attention, its
    ``attention_bias``), the q/k norms where ``shape.qk_norm`` (of one head, or of all heads
    where ``shape.qk_norm_over_heads``), MLA's latent projections and norms, RMSNorm weights; a sparse
    layer holds all ``num_experts`` experts, the router and the shared expert with its gate (if
    any), whichever few a token runs; gpt-oss's o_proj bias, sinks and router and expert biases
    where ``shape`` has them."""
    h, f = shape.hidden_size, shape.intermediate_size
    attention = _attention_parameters(shape)
    dense = attention + 3 * h * f
    shared = shape.shared_expert_intermediate_size
    f_e = shape.expert_intermediate_size
    experts = shape.num_experts * (3 * h * f_e + h)  # the router's weight is h per expert
    if shape.expert_bias:  # router, gate/up (2 f_e) and down (h) biases per expert
        experts += shape.num_experts * (1 + 2 * f_e + h)
    gate = h if shape.shared_expert_gate else 0
    sparse = attention + experts + (3 * h * shared + gate if shared else 0)
    layers = shape.dense_layers * dense + shape.sparse_layers * sparse
    largest = max(dense if shape.dense_layers else 0, sparse if shape.sparse_layers else 0)
    embedding = shape.vocab_size * h
    tied = shape.tied_embeddings if tied_head is None else tied_head
    outside = embedding + h + (0 if tied else embedding)
    return ParameterCount(largest, layers, outside, shape.vision_parameters)


@dataclass(frozen=True)
class ModelStateEstimate:
    """Bytes one rank holds besides activations.

    Attributes:
        parameters: the parameters as stored (bf16 copies or float32 masters, whole or shard).
        gradients: the accumulated gradients (whole or shard).
        optimizer: AdamW's two float32 moments and, where the parameters are bf16, the float32
            master copy.
        transient: working copies: DDP's gradient buckets and autocast's bf16 weight cache,
            ZeRO-2's reduce / all-gather buckets, FSDP2's gathered bf16 root and layers, a
            layer's bf16 gradient and its float32 reduce-scatter input.
    """

    parameters: float
    gradients: float
    optimizer: float
    transient: float

    @property
    def total(self) -> float:
        """Every byte of the estimate."""
        return self.parameters + self.gradients + self.optimizer + self.transient


def model_state_bytes(
    shape: ModelShape, strategy: MemoryStrategy, *, cp_size: int, world_size: int
) -> ModelStateEstimate:
    """What one rank holds besides activations, under ``strategy`` with bf16 compute, float32
    master weights and AdamW.

    - ``"ddp"`` (``precision="bf16-mixed"``): float32 parameters, gradients and moments on every
      rank (16 B per parameter), DDP's float32 gradient buckets (4 B) and autocast's bf16 weight
      cache, alive over the step's micro-batches (2 B).
    - ``"zero2"`` (DeepSpeed bf16): bf16 parameters on every rank (2 B); bf16 gradients, the
      float32 master and moments partitioned over the world (14 B / world); the buckets.
    - ``"fsdp_cp"`` / ``"fsdp_world"`` (``MixedPrecisionPolicy(bf16, float32)``): float32
      parameters, gradients and moments sharded over the CP group / the world (16 B / shard);
      the root's gathered bf16 parameters (embedding and head, kept from forward to backward)
      and, for the layer in flight, its gathered bf16 parameters, the next layer's (prefetch),
      its bf16 gradient and its float32 reduce-scatter input (10 B per layer parameter).

    A tied head (``shape.tied_embeddings``) is one tensor, counted once. A vision-language
    checkpoint's vision tower and projector (``shape.vision_parameters``), which text-only
    training never runs, get no gradient: DDP and FSDP2 hold them as float32 parameters
    (whole, or sharded) and AdamW makes no moments for them, DDP leaves them out of its
    buckets, and FSDP2 gathers (bf16) those in its root unit
    (``shape.vision_root_parameters``) with the root; ZeRO-2 flattens every trainable
    parameter into its partitions, filling a missing gradient with zeros, so it counts them as
    the decoder's.

    Raises:
        ValueError: an unknown strategy, or ``world_size`` not a multiple of ``cp_size``.
    """
    if strategy not in MEMORY_STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is not one of {MEMORY_STRATEGIES}.")
    if cp_size < 1 or world_size < cp_size or world_size % cp_size:
        raise ValueError(
            f"world_size={world_size} must be a positive multiple of cp_size={cp_size}."
        )
    count = parameter_count(shape)
    n, held = count.text, count.total
    if strategy == "ddp":
        return ModelStateEstimate(4.0 * held, 4.0 * n, 8.0 * n, (4.0 + 2.0) * n)
    if strategy == "zero2":
        return ModelStateEstimate(
            2.0 * held,
            2.0 * held / world_size,
            12.0 * held / world_size,
            2.0 * DEEPSPEED_BUCKET_ELEMENTS,
        )
    shard = cp_size if strategy == "fsdp_cp" else world_size
    root = count.outside_layers + shape.vision_root_parameters
    transient = 2.0 * root + 10.0 * count.per_layer
    return ModelStateEstimate(4.0 * held / shard, 4.0 * n / shard, 8.0 * n / shard, transient)


def largest_bucket(
    shape: ModelShape,
    strategy: MemoryStrategy,
    capacity_bytes: float,
    *,
    cp_size: int,
    world_size: int,
    activation_checkpointing: bool = False,
    safety_margin: float = 0.1,
    multiple_of: int = 128,
) -> int:
    """The largest ``bucket_size`` (tokens per rank and micro-batch) whose estimated peak stays
    under ``(1 - safety_margin) * capacity_bytes``, as ``bucket_size="auto"`` chooses it from a
    measured line; 0 when the model states alone do not fit.

    The activations are the chunked loss's in bf16 (:func:`activation_bytes_per_token`, or
    :func:`activation_bytes_per_token_checkpointed`); a MoE layer's experts as
    ``"grouped_mm"`` runs them.
    """
    states = model_state_bytes(shape, strategy, cp_size=cp_size, world_size=world_size)
    if activation_checkpointing:
        per_token = activation_bytes_per_token_checkpointed(shape, chunked_loss=True)
    else:
        per_token = activation_bytes_per_token(shape, chunked_loss=True).total
    free = (1.0 - safety_margin) * capacity_bytes - states.total
    if free <= 0:
        return 0
    return (math.floor(free / per_token) // multiple_of) * multiple_of
