"""Per-sequence cost table of one global batch, shared by the policies while they plan."""

from __future__ import annotations

from collections.abc import Sequence

from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.plan import shard_tokens


class SequenceCosts:
    """Seconds of each sequence of a global batch under every placement, computed on demand.

    Lengths repeat across a batch only by chance, so values are cached per sequence id; the
    distributed attention (``O(cp_size)`` to compute) is only evaluated for sequences a policy
    actually considers distributing.

    Args:
        lengths: sequence lengths of the global batch.
        cp_size: ranks of one CP group.
        cost_model: the estimate to use.
    """

    def __init__(self, lengths: Sequence[int], cp_size: int, cost_model: CostModel) -> None:
        self.lengths = lengths
        self.cp_size = cp_size
        self.cost_model = cost_model
        self._linear_per_token = cost_model.linear_seconds(1)
        self._comm_fixed = cost_model.num_collectives(cp_size) * cost_model.comm_latency_s
        self._comm_per_token = cost_model.comm_bytes(1, cp_size) / cost_model.comm_bandwidth
        self._attn: dict[int, float] = {}
        self._dist: dict[int, float] = {}

    def linear(self, sid: int) -> float:
        """Seconds of the sequence's non-attention matmuls (all ranks together)."""
        return self.lengths[sid] * self._linear_per_token

    def local_attention(self, sid: int) -> float:
        """Seconds of the sequence's attention when kept whole on one rank."""
        value = self._attn.get(sid)
        if value is None:
            value = self.cost_model.local_attention_seconds(self.lengths[sid])
            self._attn[sid] = value
        return value

    def local(self, sid: int) -> float:
        """Seconds of the sequence kept whole on one rank."""
        return self.linear(sid) + self.local_attention(sid)

    def distributed(self, sid: int) -> float:
        """Compute seconds of the sequence on each CP rank when distributed (no comm)."""
        value = self._dist.get(sid)
        if value is None:
            s = self.lengths[sid]
            value = s * self._linear_per_token / self.cp_size
            value += self.cost_model.distributed_attention_seconds(s, self.cp_size)
            self._dist[sid] = value
        return value

    def shard(self, sid: int) -> int:
        """Tokens the sequence takes on every CP rank when distributed (the ceiling)."""
        return shard_tokens(self.lengths[sid], self.cp_size)

    def comm(self, distributed_tokens: int) -> float:
        """Communication seconds of a micro-batch whose distributed sequences hold that many tokens."""
        if distributed_tokens == 0 or self.cp_size == 1:
            return 0.0
        return self._comm_fixed + self._comm_per_token * distributed_tokens
