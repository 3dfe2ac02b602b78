"""Estimated time of a micro-batch on one CP group, from the model's shape and a few constants.

The model is deliberately simple and explicit, so that every number can be checked by hand:

* **Compute.** Forward FLOPs of a Qwen2-style decoder (GQA projections or DeepSeek's latent
  ones, SwiGLU MLP or the experts a token is routed to, causal attention, LM head), counted by
  :class:`~lightning_skrull.scheduling.shapes.ModelShape`; training costs
  ``train_flops_factor`` (3) times the forward; time is FLOPs divided by ``achieved_flops``.
* **Tiles.** Attention kernels work on ``tile_size`` x ``tile_size`` blocks of (query, key)
  pairs and compute every block that holds at least one unmasked pair. A short sequence, and
  even more a short sequence cut into ``2 * cp_size`` zigzag chunks, pays for padded blocks
  (the block counts are :mod:`~lightning_skrull.scheduling.tiles`').
* **Sliding windows.** A layer with a window of ``W`` keys computes, for a sequence of ``s > W``
  tokens, ``W (W + 1) / 2 + (s - W) W`` pairs instead of ``s (s + 1) / 2``, and its kernel skips
  the key blocks before each query block's window
  (:func:`~lightning_skrull.scheduling.tiles.window_tiles`). The full-attention and the
  windowed layers are counted apart (``ModelShape.sliding_layers``); a model without a window
  gets exactly the full-attention numbers.
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

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_skrull.scheduling.plan import DISTRIBUTED, MicroBatchPlan
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, ModelShape
from lightning_skrull.scheduling.tiles import (
    causal_tiles,
    window_tiles,
    zigzag_tiles,
    zigzag_window_tiles,
)


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
