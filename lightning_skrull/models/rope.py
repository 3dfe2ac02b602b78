"""RoPE scaling under Skrull: which rope types give single-process results, and up to which length.

A rank packs several sequences (positions restart at 0 in each) and holds zigzag shards of the
distributed ones (each token keeps its position in the whole sequence), so the rotary embedding
of one forward sees the positions of many sequences at once. transformers (5.x) computes the
frequencies of a rope type in one of two ways:

- from the config only (``"default"``, ``"linear"``, ``"yarn"``, ``"llama3"``): every token's
  cos / sin depend on its position and the config alone, so Skrull computes exactly what one
  process computes on each sequence (:data:`STATIC_ROPE_TYPES`);
- from the largest position id of the forward's batch (``"dynamic"``, ``"longrope"``; the
  rotary embedding's forward is wrapped by ``dynamic_rope_update``): ``"dynamic"`` NTK-scales
  the base once ``max(position_ids) + 1`` exceeds ``max_position_embeddings``, ``"longrope"``
  switches from ``short_factor`` to ``long_factor`` once it exceeds
  ``rope_parameters["original_max_position_embeddings"]``. Under Skrull that maximum is the one
  of the whole rank, so a short sequence would get the frequencies its long neighbour sets, and
  the ranks of a CP group would use different frequencies for the shards of one sequence. Below
  the threshold both keep the frequencies computed at construction, which are what one process
  computes on a sequence that short: exact when every sequence is at most that long
  (:data:`BATCH_DEPENDENT_ROPE_TYPES`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, cast

import torch
from torch import nn

from lightning_skrull.models.families.vision_language import language_model

STATIC_ROPE_TYPES: frozenset[str] = frozenset({"default", "linear", "yarn", "llama3"})
"""Rope types whose frequencies depend on the config only: exact under Skrull at any length."""

BATCH_DEPENDENT_ROPE_TYPES: Mapping[str, str] = MappingProxyType(
    {"dynamic": "max_position_embeddings", "longrope": "original_max_position_embeddings"}
)
"""Rope types whose frequencies depend on the batch's largest position id -> the config field
below which they keep the frequencies of construction."""


def rotary_embeddings(model: nn.Module) -> list[nn.Module]:
    """The rotary embedding modules of ``model``'s text decoder (those with a ``rope_type`` and
    ``inv_freq``; a vision tower's, such as Pixtral's 2-D ``"axial"`` one, never runs on text)."""
    return [
        m
        for m in language_model(model).modules()
        if hasattr(m, "rope_type") and isinstance(getattr(m, "inv_freq", None), torch.Tensor)
    ]


def _rope_type(rotary: nn.Module) -> str:
    return str(getattr(rotary, "rope_type", "default"))


def _rope_limit(rotary: nn.Module) -> int:
    """Longest sequence for which a batch-dependent rotary embedding keeps its initial frequencies.

    ``"dynamic"`` grows when ``max(position_ids) + 1 > max_seq_len_cached``, which starts at
    ``original_max_seq_len`` (``config.max_position_embeddings``); ``"longrope"`` takes the long
    factors when ``max(position_ids) + 1 > original_max_position_embeddings``.
    """
    module = cast(Any, rotary)  # a transformers rotary embedding: untyped attributes
    if _rope_type(rotary) == "dynamic":
        return int(module.original_max_seq_len)
    return int(module.config.rope_parameters["original_max_position_embeddings"])


def rope_length_limit(model: nn.Module) -> tuple[str, int] | None:
    """``(rope type, longest exact sequence)`` of a batch-dependent RoPE, ``None`` for a static one.

    Unknown rope types give ``None`` here; :func:`rope_problems` refuses them.
    """
    limits = [
        (_rope_type(r), _rope_limit(r))
        for r in rotary_embeddings(model)
        if _rope_type(r) in BATCH_DEPENDENT_ROPE_TYPES
    ]
    return min(limits, key=lambda item: item[1]) if limits else None


def rope_problems(model: nn.Module, max_sequence_length: int | None) -> list[str]:
    """Reasons why the rotary embeddings of ``model`` would differ under Skrull (empty: exact).

    Args:
        model: a Hugging Face decoder.
        max_sequence_length: longest sequence that will be trained on, if promised.
    """
    problems: list[str] = []
    accepted = ", ".join(repr(t) for t in sorted(STATIC_ROPE_TYPES))
    for rotary in rotary_embeddings(model):
        rope_type = _rope_type(rotary)
        if rope_type in STATIC_ROPE_TYPES:
            continue
        if rope_type not in BATCH_DEPENDENT_ROPE_TYPES:
            problems.append(
                f"its RoPE type {rope_type!r} is not one whose frequencies Skrull knows to depend "
                f"on the config only (accepted: {accepted}; 'dynamic' and 'longrope' up to their "
                "threshold length)"
            )
            continue
        limit = _rope_limit(rotary)
        field = BATCH_DEPENDENT_ROPE_TYPES[rope_type]
        cached = int(getattr(rotary, "max_seq_len_cached", limit))
        if rope_type == "dynamic" and max_sequence_length == limit and cached > limit:
            # only a forward on fewer than `limit` positions resets a grown dynamic RoPE
            problems.append(
                f"its 'dynamic' RoPE was grown by an earlier forward over {cached} positions and "
                f"keeps those frequencies for a batch of exactly {limit} positions (run a forward "
                f"on fewer than {limit} positions first, or reload the model)"
            )
        if max_sequence_length is not None and max_sequence_length <= limit:
            continue
        given = (
            "no max_sequence_length was given"
            if max_sequence_length is None
            else f"max_sequence_length={max_sequence_length} exceeds it"
        )
        problems.append(
            f"its RoPE type {rope_type!r} sets the rotary frequencies of each forward from the "
            f"largest position id in it (they change once it passes {field}={limit}), so under "
            "Skrull a sequence would get the frequencies that the sequences packed with it set, "
            "and the CP ranks holding shards of one sequence different ones; it equals one process "
            f"only for sequences of at most {limit} tokens, and {given} (promise sequences no "
            f"longer with prepare_model(..., max_sequence_length<={limit}), which the Skrull "
            "strategies set to cp_size * bucket_size, or train with a rope type whose "
            f"frequencies depend on the config only: {accepted})"
        )
    return problems
