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
  direction, each ``comm_latency_s`` plus bytes over ``comm_bandwidth``. A sequence sharded
  over a block of ``d`` ranks (``CpBlock``) is exchanged over its block only: each block rank
  receives ``(d - 1) / d`` of the block's K/V, one collective per layer, direction and block
  size in use.
* **Topology.** With ``ranks_per_node`` set, an exchange whose ranks sit on more than one node
  (:func:`~lightning_skrull.scheduling.topology.spans_nodes`) pays ``inter_node_latency_s`` and
  ``inter_node_bandwidth`` for all its bytes (a ring or tree all-gather over nodes runs at the
  pace of its slowest hop); one inside a node pays ``comm_latency_s`` and ``comm_bandwidth``.
  ``ranks_per_node=None`` prices every exchange at the node's constants.
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

Blocks (a simple rule, :func:`block_rank_times`): every exchange of rank ``j`` (its blocks',
one per block size, then the whole group's) runs on one communication stream, started before
the local attention; rank ``j``'s blocks join the first K/V group. With ``B_j`` and ``b_j``
the exchange and the attention of rank ``j``'s block sequences, the attention part is
``max(local_attention(j), B_j + c_1) + b_j + D`` with one group, and the pipeline over
``(B_j + c_1, c_2, ..)`` and ``(b_j + d_1, d_2, ..)`` with more. The linear work of a block
sequence (``length / d`` tokens and the per-sequence cost) falls on its block's ranks only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from lightning_skrull.scheduling.plan import DISTRIBUTED, CpBlock, MicroBatchPlan
from lightning_skrull.scheduling.shapes import QWEN2_5_0_5B, ModelShape
from lightning_skrull.scheduling.tiles import (
    causal_tiles,
    window_tiles,
    zigzag_tiles,
    zigzag_window_tiles,
)
from lightning_skrull.scheduling.topology import check_ranks_per_node, spans_nodes


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


def block_rank_times(
    linear: Sequence[float],
    attention: Sequence[float],
    block_comm: Sequence[float],
    block_attention: Sequence[float],
    comm: Sequence[float],
    dist_attention: Sequence[float],
) -> list[float]:
    """Seconds of every CP rank of a micro-batch with blocks, without the overhead and the
    whole-group sequences' linear work (module docstring's rule for blocks).

    Args:
        linear: per rank, the linear work of its local and block sequences.
        attention: per rank, the attention of its local sequences.
        block_comm: per rank, the exchange seconds of its blocks (all block sizes).
        block_attention: per rank, the attention of its block sequences.
        comm: per K/V group of the whole-group sequences, its exchange seconds.
        dist_attention: per K/V group, its distributed attention seconds.
    """
    total = sum(dist_attention)
    if len(comm) <= 1:
        first = comm[0] if comm else 0.0
        return [
            lin + max(b + first, a) + ba + total
            for lin, a, b, ba in zip(linear, attention, block_comm, block_attention, strict=True)
        ]
    out = []
    for lin, a, b, ba in zip(linear, attention, block_comm, block_attention, strict=True):
        span, _ = kv_pipeline_span(
            [b + comm[0], *comm[1:]], [ba + dist_attention[0], *dist_attention[1:]]
        )
        out.append(lin + max(a + ba + total, span))
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
        ranks_per_node: GPUs of one node, to price exchanges that cross nodes (see the module
            docstring); ``None`` (default): the whole CP group shares one node's links. The
            strategies fill it in from the launch unless it is set here.
        inter_node_bandwidth: bytes per second one rank receives in an all-gather whose ranks
            span nodes. Default 30 GB/s: InfiniBand NDR at 400 Gb/s per GPU is 50 GB/s peak,
            and NCCL's all-gather over two or more such nodes reaches about 25-40 GB/s of bus
            bandwidth at the megabyte messages of one layer's K/V (nccl-tests on DGX H100-class
            nodes); 30 GB/s sits in that range, nearer its low end.
        inter_node_latency_s: fixed seconds of one collective whose ranks span nodes. Default
            20 us: a small-message all-gather across an InfiniBand switch takes about 10-20 us
            more than inside a node (NIC, switch hop and NCCL's proxy thread); this is the top
            of that range.
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
    ranks_per_node: int | None = None
    inter_node_bandwidth: float = 30e9
    inter_node_latency_s: float = 20e-6

    def __post_init__(self) -> None:
        if not isinstance(self.shape, ModelShape):
            raise TypeError(
                f"CostModel.shape must be a ModelShape, got {type(self.shape).__name__}; "
                "build it with CostModel.from_hf_config(config)."
            )
        positive = (
            "achieved_flops",
            "comm_bandwidth",
            "train_flops_factor",
            "inter_node_bandwidth",
        )
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0 or math.isinf(value):
                raise ValueError(
                    f"CostModel.{name}={value!r} is invalid; give a finite number > 0."
                )
        check_ranks_per_node(self.ranks_per_node)
        for name in (
            "micro_batch_overhead_s",
            "per_sequence_seconds",
            "comm_latency_s",
            "inter_node_latency_s",
        ):
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

    def link(self, cp_ranks: range, cp_size: int) -> tuple[float, float]:
        """``(latency_s, bandwidth)`` of an exchange over ``cp_ranks`` of a CP group of
        ``cp_size``: the inter-node constants when those ranks span nodes, else the node's."""
        if spans_nodes(cp_ranks, cp_size=cp_size, ranks_per_node=self.ranks_per_node):
            return self.inter_node_latency_s, self.inter_node_bandwidth
        return self.comm_latency_s, self.comm_bandwidth

    def exchange_seconds(self, tokens: int, cp_ranks: range, cp_size: int) -> float:
        """Seconds of the K/V exchange of sequences of ``tokens`` whole tokens sharded over
        ``cp_ranks`` (a block, or the whole group) of a CP group of ``cp_size``: its
        collectives' latency plus the bytes one of its ranks receives over the link's
        bandwidth (0 with no tokens or one rank)."""
        d = len(cp_ranks)
        if tokens == 0 or d == 1:
            return 0.0
        latency, bandwidth = self.link(cp_ranks, cp_size)
        return self.num_collectives(d) * latency + self.comm_bytes(tokens, d) / bandwidth

    def comm_seconds(self, distributed_tokens: int, cp_size: int) -> float:
        """Seconds of the K/V communication of a micro-batch's whole-group sequences (0 with
        nothing distributed)."""
        return self.exchange_seconds(distributed_tokens, range(cp_size), cp_size)

    # ----------------------------------------------------------------- micro-batch time
    def rank_seconds(self, mb: MicroBatchPlan, lengths: Sequence[int], cp_size: int) -> list[float]:
        """Estimated seconds of every CP rank of one micro-batch (overhead included)."""
        if mb.block_sizes():
            return self._block_rank_seconds(mb, lengths, cp_size)
        linear = [0.0] * cp_size
        attn = [0.0] * cp_size
        dist: list[int] = []
        per_sequence = self.per_sequence_seconds
        for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
            s = lengths[sid]
            if where == DISTRIBUTED:
                dist.append(s)
            else:
                assert isinstance(where, int)  # blocks took the other path
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

    def _block_rank_seconds(
        self, mb: MicroBatchPlan, lengths: Sequence[int], cp_size: int
    ) -> list[float]:
        """:meth:`rank_seconds` of a micro-batch with blocks (:func:`block_rank_times`)."""
        linear, attn = [0.0] * cp_size, [0.0] * cp_size
        block_attn = [0.0] * cp_size
        block_tokens: dict[CpBlock, int] = {}
        dist: list[int] = []
        per_sequence = self.per_sequence_seconds
        for sid, where in zip(mb.sequence_ids, mb.placement, strict=True):
            s = lengths[sid]
            if isinstance(where, CpBlock):
                block_tokens[where] = block_tokens.get(where, 0) + s
                lin = self.linear_seconds(s / where.size) + per_sequence
                att = self.distributed_attention_seconds(s, where.size)
                for j in where.ranks:
                    linear[j] += lin
                    block_attn[j] += att
            elif where == DISTRIBUTED:
                dist.append(s)
            else:
                linear[where] += self.linear_seconds(s) + per_sequence
                attn[where] += self.local_attention_seconds(s)
        block_comm = [0.0] * cp_size
        for block, tokens in block_tokens.items():
            seconds = self.exchange_seconds(tokens, block.ranks, cp_size)
            for j in block.ranks:
                block_comm[j] += seconds
        ranges = mb.kv_group_ranges()
        comm = [self.comm_seconds(sum(dist[a:b]), cp_size) for a, b in ranges]
        dist_attn = [
            sum(self.distributed_attention_seconds(s, cp_size) for s in dist[a:b])
            for a, b in ranges
        ]
        base = self.micro_batch_overhead_s + self.linear_seconds(sum(dist) / cp_size)
        base += per_sequence * len(dist)
        times = block_rank_times(linear, attn, block_comm, block_attn, comm, dist_attn)
        return [base + t for t in times]
