"""One rank's packed micro-batches of a global batch, from its plan.

Every rank of a DP x CP world receives the same global batch (a list of samples) and the same
:class:`~lightning_skrull.scheduling.plan.GlobalBatchPlan`, and builds only its own micro-batches:

- ``input_ids`` ``[1, T]``: this CP rank's tokens in the packed order of its
  :class:`~lightning_skrull.attention.layout.RankLayout` (local sequences whole, then its zigzag
  chunks of the distributed sequences).
- ``position_ids`` ``[1, T]``: every token's position inside its own sequence (a shard keeps its
  sequence's positions), so RoPE sees exactly what it sees on one process.
- ``shift_labels`` and ``labels`` ``[1, T]`` (the same tensor): labels shifted per sequence
  **before** sharding: token ``i`` carries the label of token ``i + 1`` of its sequence and the
  last token of every sequence carries ``-100``. No rank needs its neighbour's token.
- ``num_items_in_batch``: ``max(S, 1) / world_size`` with ``S`` the supervised tokens (shifted
  labels ``!= -100``) of the whole global batch, counted here, before sharding.

transformers' causal-LM loss sums the token losses of ``shift_labels`` and divides by
``num_items_in_batch``; see docs/loss.md for why that makes the step gradient the global token
mean.

A CP rank that holds no token of a micro-batch (the plan put nothing on it) gets one placeholder
token (id 0, position 0, label -100) as a local sequence of its own: a Hugging Face decoder
cannot run a forward on zero tokens, and the placeholder adds zero loss and zero gradient.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lightning_skrull.attention.layout import RankLayout, build_rank_layout, pack, zigzag_chunks
from lightning_skrull.data.dataset import IGNORE_INDEX
from lightning_skrull.scheduling.plan import (
    DISTRIBUTED,
    GlobalBatchPlan,
    MicroBatchPlan,
    rank_or_group,
)

PLACEHOLDER_TOKEN_ID = 0
"""Input id of the placeholder token given to a CP rank that holds no token of a micro-batch."""

MODEL_INPUT_KEYS = ("input_ids", "position_ids", "labels", "shift_labels", "num_items_in_batch")
"""Keys of :attr:`MicroBatch.inputs`, the keyword arguments of the model's forward."""


@dataclass(eq=False)
class MicroBatch:
    """One micro-batch of one rank: the model's keyword arguments and the attention layout.

    ``model(**micro_batch.inputs).loss`` is this rank's share of the global step loss; run it
    inside ``micro_batch_context(micro_batch, cp_group)`` so the attention sees :attr:`layout`.

    Attributes:
        inputs: ``input_ids``, ``position_ids``, ``labels``, ``shift_labels`` (all ``[1, T]``
            long) and ``num_items_in_batch`` (0-dim float).
        layout: this CP rank's packed token layout (sequence ids index the global batch;
            ids ``>= len(global batch)`` are placeholder tokens).
        sample_indices: the sample indices of the micro-batch's sequences (all of them, also
            those held by other CP ranks), plan order; empty for a padding micro-batch.
        num_placeholder_tokens: 1 when this rank got a placeholder token, else 0.
    """

    inputs: dict[str, torch.Tensor]
    layout: RankLayout
    sample_indices: tuple[int, ...]
    num_placeholder_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Tokens fed to the model on this rank (placeholders included)."""
        return int(self.inputs["input_ids"].shape[1])

    @property
    def num_supervised_tokens(self) -> int:
        """Supervised tokens of this rank's share (shifted labels ``!= -100``)."""
        return int((self.inputs["shift_labels"] != IGNORE_INDEX).sum())

    @property
    def device(self) -> torch.device:
        """Device of the input tensors."""
        return self.inputs["input_ids"].device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> MicroBatch:
        """A copy with every input tensor on ``device`` (the layout is plain data)."""
        moved = {k: v.to(device, non_blocking=non_blocking) for k, v in self.inputs.items()}
        return replace(self, inputs=moved)


@dataclass(eq=False)
class RankBatch:
    """One rank's micro-batches for one optimizer step.

    Attributes:
        micro_batches: run in order; padding micro-batches (see ``min_micro_batches`` of
            :func:`collate_rank`) come last.
        plan: the global batch's plan (the same on every rank).
        sample_indices: the sample indices of the whole global batch, in global-batch order.
        num_supervised_tokens: supervised tokens of the whole global batch, before sharding.
        dp_rank: this rank's DP rank.
        cp_rank: this rank's CP rank.
        world_size: ranks over which gradients are averaged (``dp_size * cp_size``).
        fingerprint: CRC-32 of the whole global batch's lengths, token ids and labels (every
            sample, not only this rank's): equal on every rank exactly when all ranks hold the
            same samples; checked with the plan before the first collective of a step.
    """

    micro_batches: list[MicroBatch]
    plan: GlobalBatchPlan
    sample_indices: tuple[int, ...]
    num_supervised_tokens: int
    dp_rank: int
    cp_rank: int
    world_size: int
    fingerprint: int = 0

    def __len__(self) -> int:
        return len(self.micro_batches)

    @property
    def num_planned_micro_batches(self) -> int:
        """Micro-batches the plan gives this DP rank (without padding ones)."""
        return self.plan.num_micro_batches(self.dp_rank)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RankBatch:
        """A copy with every micro-batch on ``device``."""
        moved = [mb.to(device, non_blocking=non_blocking) for mb in self.micro_batches]
        return replace(self, micro_batches=moved)


def shift_sequence_labels(labels: torch.Tensor) -> torch.Tensor:
    """Labels of one sequence shifted for next-token prediction.

    ``out[i] = labels[i + 1]`` and ``out[-1] = -100``: what token ``i`` must predict. The first
    label of a sequence is never a target.
    """
    out = torch.full_like(labels, IGNORE_INDEX)
    out[:-1] = labels[1:]
    return out


def sample_length(sample: Mapping[str, Any], index: int = 0) -> int:
    """Tokens of one sample (``len(sample["input_ids"])``).

    Raises:
        TypeError: the sample is not a mapping with ``input_ids``.
    """
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        raise TypeError(
            f"sample {index} must be a mapping with 'input_ids' (and optionally 'labels'), got "
            f"{type(sample).__name__}."
        )
    return len(sample["input_ids"])


def sample_lengths(samples: Sequence[Mapping[str, Any]]) -> list[int]:
    """Tokens of every sample of a global batch (:func:`sample_length`), in order: the one
    measure the planner and the collation use.

    Raises:
        TypeError: a sample is not a mapping with ``input_ids``.
    """
    return [sample_length(s, i) for i, s in enumerate(samples)]


def _as_tokens(value: Any, name: str, index: int) -> torch.Tensor:
    tensor = torch.as_tensor(value)
    if tensor.dim() != 1:
        raise ValueError(
            f"sample {index}: {name} must be one-dimensional (one sequence), got shape "
            f"{tuple(tensor.shape)}."
        )
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise TypeError(f"sample {index}: {name} must hold integers, got dtype {tensor.dtype}.")
    return tensor.to(torch.long)


def _crc32(tensor: torch.Tensor, value: int) -> int:
    """CRC-32 of a CPU tensor's bytes, continuing the checksum ``value``."""
    # An ndarray has the buffer protocol at runtime; numpy's stubs declare ``__buffer__`` only
    # for Python >= 3.12, so the check against ``Buffer`` fails on older targets.
    return zlib.crc32(tensor.contiguous().numpy(), value)  # type: ignore[arg-type]


def _sample_tensors(sample: Mapping[str, Any], index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, shifted labels)`` of one sample, validated."""
    sample_length(sample, index)
    input_ids = _as_tokens(sample["input_ids"], "input_ids", index)
    if input_ids.numel() < 1:
        raise ValueError(f"sample {index} has no token; every sample needs at least one.")
    labels_value = sample.get("labels")
    if labels_value is None:
        labels = input_ids
    else:
        labels = _as_tokens(labels_value, "labels", index)
        if labels.numel() != input_ids.numel():
            raise ValueError(
                f"sample {index} has {input_ids.numel()} input_ids but {labels.numel()} labels; "
                "give one label per token (-100 for tokens that are not supervised)."
            )
    return input_ids, shift_sequence_labels(labels)


def count_supervised_tokens(samples: Sequence[Mapping[str, Any]]) -> int:
    """Supervised tokens of a global batch: shifted labels ``!= -100``, before any sharding.

    A sample without ``labels`` supervises every token but its first.
    """
    return sum(int((_sample_tensors(s, i)[1] != IGNORE_INDEX).sum()) for i, s in enumerate(samples))


def tokens_per_cp_rank(mb: MicroBatchPlan, lengths: Sequence[int], cp_size: int) -> list[int]:
    """Exact tokens each CP rank holds in a micro-batch (floor/ceil shares of distributed ones)."""
    tokens = [0] * cp_size
    for sid, placed in zip(mb.sequence_ids, mb.placement, strict=True):
        where = rank_or_group(placed)
        if where == DISTRIBUTED:
            chunks = zigzag_chunks(lengths[sid], cp_size)
            for r in range(cp_size):
                for c in (r, 2 * cp_size - 1 - r):
                    tokens[r] += chunks[c][1] - chunks[c][0]
        else:
            tokens[where] += lengths[sid]
    return tokens


def _check_plan(plan: GlobalBatchPlan, num_samples: int, lengths: Sequence[int]) -> None:
    counts = Counter(plan.all_sequence_ids())
    if len(counts) != num_samples or any(
        n != 1 or not 0 <= s < num_samples for s, n in counts.items()
    ):
        missing = [s for s in range(num_samples) if s not in counts]
        wrong = sorted(s for s, n in counts.items() if n != 1 or not 0 <= s < num_samples)
        raise ValueError(
            f"the plan must place every sample of the global batch exactly once; {num_samples} "
            f"samples, missing {missing}, duplicated or out of range {wrong}. Plan the same "
            "global batch you collate."
        )
    for dp_rank, mbs in enumerate(plan.micro_batches):
        for i, mb in enumerate(mbs):
            for cp_rank, tokens in enumerate(tokens_per_cp_rank(mb, lengths, plan.cp_size)):
                if tokens > plan.bucket_size:
                    raise RuntimeError(
                        f"micro-batch {i} of DP rank {dp_rank} puts {tokens} tokens on CP rank "
                        f"{cp_rank}, over the bucket of {plan.bucket_size} tokens; the plan "
                        f"(policy {plan.policy!r}) breaks its memory budget. This is a planner "
                        "bug: report it with the sequence lengths of the global batch."
                    )


def collate_rank(
    samples: Sequence[Mapping[str, Any]],
    plan: GlobalBatchPlan,
    *,
    dp_rank: int,
    cp_rank: int,
    world_size: int,
    sample_indices: Sequence[int] | None = None,
    min_micro_batches: int | None = None,
    lengths: Sequence[int] | None = None,
) -> RankBatch:
    """Build this rank's micro-batches of one global batch.

    Args:
        samples: the global batch, indexed like the plan's sequence ids; each a mapping with
            ``input_ids`` (1-D ints) and optionally ``labels`` (same length, ``-100`` = not
            supervised; missing = every token supervised).
        plan: the global batch's plan, identical on every rank.
        dp_rank: this rank's DP rank.
        cp_rank: this rank's rank in its CP group.
        world_size: ranks over which gradients are averaged; must be
            ``plan.dp_size * plan.cp_size``.
        sample_indices: dataset indices of ``samples`` (default ``0..len(samples)-1``).
        min_micro_batches: pad with empty micro-batches (one placeholder token per CP rank,
            zero loss and zero gradient) up to this count, so that every DP rank runs the same
            number of forward/backward passes (pass the plan's maximum over DP ranks).
        lengths: the samples' lengths as :func:`sample_lengths` measured them (the plan's);
            measured here when ``None``.

    Returns:
        The rank's :class:`RankBatch` (on CPU).

    Raises:
        ValueError: ranks or world size that do not match the plan, a plan that does not place
            every sample exactly once, or malformed samples.
        TypeError: a sample that is not a mapping with integer ``input_ids``.
        RuntimeError: the plan puts more tokens on a CP rank than ``plan.bucket_size``.
    """
    if world_size != plan.dp_size * plan.cp_size:
        raise ValueError(
            f"world_size {world_size} does not match the plan's dp_size {plan.dp_size} x cp_size "
            f"{plan.cp_size}; plan with the world's sizes."
        )
    if not 0 <= dp_rank < plan.dp_size:
        raise ValueError(f"dp_rank {dp_rank} is outside [0, {plan.dp_size}).")
    if not 0 <= cp_rank < plan.cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside [0, {plan.cp_size}).")
    if sample_indices is None:
        sample_indices = range(len(samples))
    indices = tuple(int(i) for i in sample_indices)
    if len(indices) != len(samples):
        raise ValueError(
            f"got {len(samples)} samples but {len(indices)} sample indices; give one index per "
            "sample."
        )
    if lengths is None:
        lengths = sample_lengths(samples)
    elif len(lengths) != len(samples):
        raise ValueError(
            f"got {len(samples)} samples but {len(lengths)} lengths; give one length per sample."
        )
    else:
        lengths = [int(length) for length in lengths]  # a list: its repr starts the fingerprint
    for i, length in enumerate(lengths):
        if length < 1:
            raise ValueError(f"sample {i} has no token; every sample needs at least one.")
    _check_plan(plan, len(samples), lengths)

    num_supervised = 0
    fingerprint = zlib.crc32(repr(lengths).encode())
    token_ids: dict[int, torch.Tensor] = {}
    shifted: dict[int, torch.Tensor] = {}
    mine = {s for mb in plan.micro_batches[dp_rank] for s in mb.sequence_ids}
    for i, sample in enumerate(samples):
        ids, labels = _sample_tensors(sample, i)
        fingerprint = _crc32(labels, _crc32(ids, fingerprint))
        num_supervised += int((labels != IGNORE_INDEX).sum())
        if i in mine:
            token_ids[i], shifted[i] = ids, labels
    num_items = torch.tensor(max(num_supervised, 1) / world_size, dtype=torch.float32)

    mb_plans = list(plan.micro_batches[dp_rank])
    if min_micro_batches is not None and min_micro_batches > len(mb_plans):
        mb_plans += [MicroBatchPlan((), ())] * (min_micro_batches - len(mb_plans))
    micro_batches = [
        _collate_micro_batch(
            mb, lengths, token_ids, shifted, cp_rank, plan.cp_size, num_items, indices
        )
        for mb in mb_plans
    ]
    return RankBatch(
        micro_batches=micro_batches,
        plan=plan,
        sample_indices=indices,
        num_supervised_tokens=num_supervised,
        dp_rank=dp_rank,
        cp_rank=cp_rank,
        world_size=world_size,
        fingerprint=fingerprint,
    )


def _collate_micro_batch(
    mb: MicroBatchPlan,
    lengths: Sequence[int],
    token_ids: Mapping[int, torch.Tensor],
    shifted: Mapping[int, torch.Tensor],
    cp_rank: int,
    cp_size: int,
    num_items: torch.Tensor,
    sample_indices: Sequence[int],
) -> MicroBatch:
    sequence_ids = list(mb.sequence_ids)
    placement = list(mb.placement)
    # Placeholder of CP rank r: sequence id len(lengths) + r, one token, local on r. Every CP
    # rank adds the same placeholders (one per empty rank), so all layouts of the group agree.
    all_lengths = [*lengths, *([1] * cp_size)]
    placeholder_id: int | None = None
    for r, n in enumerate(tokens_per_cp_rank(mb, lengths, cp_size)):
        if n == 0:
            sequence_ids.append(len(lengths) + r)
            placement.append(r)
            if r == cp_rank:
                placeholder_id = len(lengths) + r
    # The placeholders are local, so the plan's K/V group counts still hold.
    layout = build_rank_layout(
        sequence_ids,
        placement,
        all_lengths,
        cp_rank=cp_rank,
        cp_size=cp_size,
        kv_groups=mb.kv_groups,
    )

    held = {seg.sequence_id for seg in layout.segments}
    ids_map = {sid: token_ids[sid] for sid in held if sid != placeholder_id}
    labels_map = {sid: shifted[sid] for sid in held if sid != placeholder_id}
    if placeholder_id is not None:
        ids_map[placeholder_id] = torch.tensor([PLACEHOLDER_TOKEN_ID], dtype=torch.long)
        labels_map[placeholder_id] = torch.tensor([IGNORE_INDEX], dtype=torch.long)
    input_ids = pack(layout, ids_map).unsqueeze(0)
    labels = pack(layout, labels_map).unsqueeze(0)
    position_ids = torch.tensor(layout.position_ids, dtype=torch.long).unsqueeze(0)
    return MicroBatch(
        inputs={
            "input_ids": input_ids,
            "position_ids": position_ids,
            "labels": labels,
            "shift_labels": labels,
            "num_items_in_batch": num_items.clone(),
        },
        layout=layout,
        sample_indices=tuple(sample_indices[s] for s in mb.sequence_ids),
        num_placeholder_tokens=0 if placeholder_id is None else 1,
    )
