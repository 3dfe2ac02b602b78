"""An analytical estimate of activation memory per token of a Hugging Face decoder step.

What autograd keeps per token for the backward of one training step (packed tokens, flash-style
attention without a score matrix, no activation checkpointing), from the model's config alone.
It explains the measured line of ``bucket_size="auto"`` (``alpha`` bytes per token) and says how
much of it the LM head takes with the dense loss and with the chunked one.

Per decoder layer, with ``b`` bytes per activation element (2 for bf16, 4 for float32), ``h``
the hidden size, ``h_kv`` the key/value width and ``f`` the MLP width:

- each of the two RMSNorms keeps its float32 copy of the input (``4h``) and its normalised
  output in the compute dtype (``b h``): ``2 (4 + b) h``;
- attention keeps q (``b h``), k and v (``2 b h_kv``) and its output (``b h``, also o_proj's
  input);
- the SwiGLU MLP keeps the gate and up projections, the SiLU output and their product
  (``4 b f``).

The head, dense (transformers' ``lm_head`` then ``ForCausalLMLoss``): the logits (``b V``), their
float32 copy when ``b < 4`` (``4 V``), log-softmax's float32 output (``4 V``), and the float32
gradient of the logits in backward (``4 V``), all alive at the head's backward, when every layer's
activations still are. Chunked (:mod:`~lightning_skrull.models.chunked_loss`): the final norm
(``(4 + b) h``) and the hidden states' gradient made in forward (``b h``); one chunk's logits are
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

from lightning_skrull.scheduling.cost_model import (
    QWEN2_5_7B,
    QWEN2_5_14B,
    QWEN2_5_32B,
    QWEN2_5_72B,
    ModelShape,
)


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


def activation_bytes_per_token(
    config: Any, *, chunked_loss: bool, bytes_per_element: int = 2
) -> ActivationEstimate:
    """Estimate activation bytes per token for a decoder with this Hugging Face ``config``.

    Args:
        config: a transformers config with ``hidden_size``, ``intermediate_size``,
            ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` (optional,
            default: MHA), ``head_dim`` (optional) and ``vocab_size``; or a
            :class:`~lightning_skrull.scheduling.cost_model.ModelShape` (``num_layers``).
        chunked_loss: the chunked LM head + cross-entropy instead of the dense logits.
        bytes_per_element: bytes of the compute dtype (2: bf16 / fp16, 4: float32).

    Returns:
        The per-token estimate, split into layers and head.
    """
    h = int(config.hidden_size)
    f = int(config.intermediate_size)
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or h // heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    q_width, kv_width = heads * head_dim, kv_heads * head_dim
    b = bytes_per_element
    norms = 2 * (4 + b) * h
    attention = b * (2 * q_width + 2 * kv_width)
    mlp = 4 * b * f
    num_layers = getattr(config, "num_hidden_layers", None) or config.num_layers
    layers = int(num_layers) * (norms + attention + mlp)
    vocab = int(config.vocab_size)
    final_norm = (4 + b) * h
    if chunked_loss:
        head = final_norm + b * h
    else:
        head = final_norm + b * vocab + (4 * vocab if b < 4 else 0) + 4 * vocab + 4 * vocab
    return ActivationEstimate(layers=float(layers), head=float(head))


def _layers_of(config: Any) -> int:
    return int(getattr(config, "num_hidden_layers", None) or config.num_layers)


def activation_bytes_per_token_checkpointed(
    config: Any, *, chunked_loss: bool, bytes_per_element: int = 2
) -> float:
    """Activation bytes per token with activation checkpointing of every decoder layer: each
    layer's input (``b h``), one layer's full activations (during its recomputation) and the
    head."""
    full = activation_bytes_per_token(
        config, chunked_loss=chunked_loss, bytes_per_element=bytes_per_element
    )
    num_layers = _layers_of(config)
    inputs = num_layers * bytes_per_element * int(config.hidden_size)
    return float(inputs + full.layers / num_layers + full.head)


# ----------------------------------------------------------------------------- model states
LARGE_MODELS = {
    "Qwen2.5-7B": QWEN2_5_7B,
    "Qwen2.5-14B": QWEN2_5_14B,
    "Qwen2.5-32B": QWEN2_5_32B,
    "Qwen2.5-72B": QWEN2_5_72B,
}
"""The shapes of the memory table in docs/strategies.md (untied heads, q/k/v biases)."""

MemoryStrategy = Literal["ddp", "zero2", "fsdp_cp", "fsdp_world"]
"""The strategies :func:`model_state_bytes` knows: ``SkrullStrategy`` (DDP),
``SkrullZero2Strategy``, ``SkrullFSDPStrategy(shard="cp")`` and ``(shard="world")``."""

MEMORY_STRATEGIES: tuple[str, ...] = get_args(MemoryStrategy)

DEEPSPEED_BUCKET_ELEMENTS = 2 * 200_000_000
"""ZeRO-2's reduce and all-gather buckets together, in elements (Lightning's defaults,
``reduce_bucket_size = allgather_bucket_size = 2e8``)."""


@dataclass(frozen=True)
class ParameterCount:
    """Parameters of a Qwen2-style decoder.

    Attributes:
        per_layer: one decoder layer (projections with q/k/v biases, MLP, two norms).
        layers: all decoder layers.
        outside_layers: the embedding, the final norm and the (untied) LM head.
    """

    per_layer: int
    layers: int
    outside_layers: int

    @property
    def total(self) -> int:
        """Every parameter."""
        return self.layers + self.outside_layers


def parameter_count(shape: ModelShape, *, tied_head: bool = False) -> ParameterCount:
    """Parameters of a Qwen2-style decoder of ``shape`` (q/k/v biases, RMSNorm weights)."""
    h, q, kv, f = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    attention = h * q + q + 2 * (h * kv + kv) + q * h
    per_layer = attention + 3 * h * f + 2 * h
    embedding = shape.vocab_size * h
    outside = embedding + h + (0 if tied_head else embedding)
    return ParameterCount(per_layer, shape.num_layers * per_layer, outside)


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
    n = count.total
    if strategy == "ddp":
        return ModelStateEstimate(4.0 * n, 4.0 * n, 8.0 * n, (4.0 + 2.0) * n)
    if strategy == "zero2":
        return ModelStateEstimate(
            2.0 * n, 2.0 * n / world_size, 12.0 * n / world_size, 2.0 * DEEPSPEED_BUCKET_ELEMENTS
        )
    shard = cp_size if strategy == "fsdp_cp" else world_size
    transient = 2.0 * count.outside_layers + 10.0 * count.per_layer
    return ModelStateEstimate(4.0 * n / shard, 4.0 * n / shard, 8.0 * n / shard, transient)


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
    :func:`activation_bytes_per_token_checkpointed`).
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
