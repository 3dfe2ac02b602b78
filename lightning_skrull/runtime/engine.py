"""One optimizer step of Skrull training, without Lightning.

:func:`train_step` is the whole step on plain ``torch.distributed``: plan the global batch
(identically on every rank), collate this rank's micro-batches
(:func:`~lightning_skrull.data.plan_batch.plan_rank_batch`), run forward and backward of each
inside its attention context, average the gradients over all DP x CP ranks, and step the
optimizer. The Lightning strategy drives the same pieces (:func:`micro_batch_context`,
:func:`all_reduce_gradients`) from its hooks.

The model must be the bare Hugging Face model after
:func:`~lightning_skrull.models.prepare_model` (not wrapped in DDP: the gradients are averaged
here, once per step).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning_skrull.attention.context import SkrullAttentionContext, attention_context
from lightning_skrull.data.collate import MicroBatch, RankBatch, sample_lengths
from lightning_skrull.data.dataset import IGNORE_INDEX
from lightning_skrull.data.plan_batch import BatchPlanning, plan_rank_batch
from lightning_skrull.models.checks import sequence_length_rule
from lightning_skrull.models.families.vision_language import text_config
from lightning_skrull.models.patching import is_prepared
from lightning_skrull.runtime.process_groups import ParallelLayout
from lightning_skrull.scheduling import CostModel, GlobalBatchPlan, Policy

GRAD_BUCKET_ELEMENTS = 1 << 25
"""Gradient elements flattened into one all-reduce (128 MiB in float32)."""


@dataclass(frozen=True)
class StepResult:
    """What one :func:`train_step` did.

    Attributes:
        loss: the step loss, identical on every rank: mean token cross-entropy over every
            supervised token of the global batch (0.0 when it has none).
        num_supervised_tokens: supervised tokens of the global batch (before sharding).
        num_micro_batches: forward/backward passes this rank ran.
        plan: the global batch's plan.
        grad_norm: total gradient norm before clipping, when ``max_grad_norm`` was given.
    """

    loss: float
    num_supervised_tokens: int
    num_micro_batches: int
    plan: GlobalBatchPlan
    grad_norm: float | None = None


@contextmanager
def micro_batch_context(
    mb: MicroBatch, cp_group: ProcessGroup | None, backend: str = "auto"
) -> Iterator[SkrullAttentionContext]:
    """Make ``mb``'s layout the current attention context.

    Run the model's forward **and** backward inside it (activation checkpointing recomputes
    the attention during backward).

    Args:
        mb: the micro-batch (its inputs already on the model's device).
        cp_group: this rank's CP group (``None`` allowed when ``cp_size == 1``).
        backend: ``"auto"``, ``"sdpa"`` or ``"flash"``.

    Yields:
        The :class:`SkrullAttentionContext` in force.
    """
    ctx = SkrullAttentionContext.build(mb.layout, group=cp_group, backend=backend, device=mb.device)
    with attention_context(ctx):
        yield ctx


def forward_backward(
    model: nn.Module,
    batch: RankBatch,
    *,
    cp_group: ProcessGroup | None,
    backend: str = "auto",
) -> torch.Tensor:
    """Forward and backward every micro-batch of ``batch``; gradients accumulate in ``.grad``.

    Returns:
        The sum of this rank's micro-batch losses (detached, 0-dim float32): this rank's share
        of the global loss times the world size.

    Raises:
        RuntimeError: the model returned no loss.
    """
    total = torch.zeros((), dtype=torch.float32, device=_model_device(model))
    for mb in batch.micro_batches:
        with micro_batch_context(mb, cp_group, backend):
            loss = getattr(model(**mb.inputs), "loss", None)
            if loss is None:
                raise RuntimeError(
                    f"{type(model).__name__} returned no loss for inputs with labels; the engine "
                    "trains causal LMs (…ForCausalLM) whose forward computes the loss."
                )
            loss.backward()
        total += loss.detach().float()
    return total


@torch.no_grad()
def all_reduce_gradients(
    parameters: Iterable[nn.Parameter], *, world_size: int, group: ProcessGroup | None = None
) -> None:
    """Average gradients over ``group`` (sum, then divide by ``world_size``), in place.

    A parameter that got no gradient on this rank (``.grad is None``) contributes zeros and
    receives the average, so every rank issues the same collectives.
    """
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    for bucket in _buckets(params):
        grads = cast("list[torch.Tensor]", [p.grad for p in bucket])  # every .grad set above
        flat = torch._utils._flatten_dense_tensors(grads)
        if world_size > 1:
            dist.all_reduce(flat, group=group)
            flat.div_(world_size)
        for grad, reduced in zip(
            grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True
        ):
            grad.copy_(reduced)


def _buckets(params: Sequence[nn.Parameter]) -> Iterator[list[nn.Parameter]]:
    """Consecutive runs of same-device, same-dtype parameters of bounded total size."""
    bucket: list[nn.Parameter] = []
    size = 0
    for p in params:
        grad = p.grad
        assert grad is not None
        if bucket and (
            size + grad.numel() > GRAD_BUCKET_ELEMENTS
            or grad.dtype != bucket[0].grad.dtype  # type: ignore[union-attr]
            or grad.device != bucket[0].grad.device  # type: ignore[union-attr]
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(p)
        size += grad.numel()
    if bucket:
        yield bucket


def check_same_plan(
    plan: GlobalBatchPlan,
    device: torch.device,
    group: ProcessGroup | None,
    *,
    fingerprint: int = 0,
) -> None:
    """Raise on every rank if the ranks of ``group`` did not plan the same global batch.

    One all-reduce of two integers (the maximum of the digest and of its negation); a mismatch
    would otherwise hang in the CP collectives or train silently on mixed data.

    Args:
        plan: this rank's plan of the global batch.
        device: where the all-reduced tensor lives (the process group's device).
        group: the ranks that must agree (the whole world).
        fingerprint: :attr:`RankBatch.fingerprint` of the global batch's contents, so that
            ranks whose samples differ but have the same lengths are caught too.

    Raises:
        RuntimeError: the plans or the samples differ between ranks.
    """
    text = f"{plan.digest()}:{fingerprint}"
    digest = int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    if int(t[0]) != digest or -int(t[1]) != digest:
        raise RuntimeError(
            f"rank {dist.get_rank()}: the ranks planned different global batches or hold "
            "different samples for it (plan and content digests differ); training on would "
            "mix data or hang. Every rank must read the same data in the same order (e.g. the "
            "same files, sorted the same way, on every node), with the same sampler seed, "
            "global_batch_size, cp_size, bucket_size, policy and cost model."
        )


def check_token_ids(
    samples: Sequence[Mapping[str, Any]],
    vocab_size: int,
    sample_indices: Sequence[int] | None = None,
) -> None:
    """Refuse token ids and labels outside the model's vocabulary, before the embedding.

    An id out of range would raise deep inside the embedding on CPU and trigger a device-side
    assert on CUDA; a label out of range would do the same in the loss.

    Raises:
        ValueError: an input id outside ``[0, vocab_size)`` or a label outside it that is not
            ``-100``, naming the sample, the position, the value and the fix.
    """
    for i, sample in enumerate(samples):
        name = f"sample {i}" if sample_indices is None else f"sample {sample_indices[i]}"
        for key in ("input_ids", "labels"):
            value = sample.get(key)
            if value is None:
                continue
            t = torch.as_tensor(value)
            if t.dim() != 1 or t.dtype.is_floating_point:
                continue  # malformed samples are named by the collate step
            bad = (t < 0) | (t >= vocab_size)
            if key == "labels":
                bad &= t != IGNORE_INDEX
            if bool(bad.any()):
                pos = int(bad.nonzero()[0, 0])
                raise ValueError(
                    f"{name}: {key}[{pos}] = {int(t[pos])} is outside the model's vocabulary "
                    f"[0, {vocab_size}){' (or -100)' if key == 'labels' else ''}. Fix: tokenise "
                    "with the model's own tokenizer, or resize the model's embeddings "
                    "(model.resize_token_embeddings) to cover the added tokens."
                )


def check_sequence_lengths(model: nn.Module, lengths: Sequence[int]) -> None:
    """Refuse sequences that the model's sliding window or batch-dependent RoPE would treat
    differently (:func:`~lightning_skrull.models.checks.sequence_length_rule`).

    Raises:
        ValueError: a sequence is longer than the model runs exactly under Skrull.
    """
    rule = sequence_length_rule(model)
    if rule is None:
        return
    limit, why = rule
    for index, length in enumerate(lengths):
        if length > limit:
            raise ValueError(
                f"sequence {index} has {length} tokens, more than {why}. Truncate it or drop it."
            )


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    samples: Sequence[Mapping[str, Any]],
    *,
    layout: ParallelLayout,
    bucket_size: int,
    policy: Policy = "skrull",
    cost_model: CostModel | None = None,
    backend: str = "auto",
    plan: GlobalBatchPlan | None = None,
    sample_indices: Sequence[int] | None = None,
    max_grad_norm: float | None = None,
    verify_plan: bool = True,
) -> StepResult:
    """Run one optimizer step on a global batch, on every rank of the DP x CP world.

    Every rank calls it with the same ``samples`` (the whole global batch).

    Args:
        model: the prepared Hugging Face causal LM (:func:`~lightning_skrull.models.prepare_model`),
            not wrapped in DDP.
        optimizer: optimizer over the model's parameters; stepped once, then its gradients are
            zeroed (``set_to_none``).
        samples: the global batch: mappings with ``input_ids`` and optional ``labels``.
        layout: this process's :class:`~lightning_skrull.runtime.process_groups.ParallelLayout`.
        bucket_size: tokens one CP rank may hold in one micro-batch.
        policy: planning policy (see :func:`~lightning_skrull.scheduling.plan_global_batch`).
        cost_model: the planner's cost model (default: the planner's).
        backend: attention backend, ``"auto"``, ``"sdpa"`` or ``"flash"``.
        plan: use this plan instead of planning (it must match the layout's sizes).
        sample_indices: dataset indices of ``samples``, recorded in the micro-batches.
        max_grad_norm: clip the averaged gradient to this total norm before the step.
        verify_plan: check with one small all-reduce that every rank planned the same.

    Returns:
        The :class:`StepResult`; ``loss`` is the global token-mean loss, equal on every rank.

    Raises:
        RuntimeError: the model is not prepared, or the ranks planned differently.
        FloatingPointError: the loss is not finite (the optimizer step is skipped).
        ValueError: an empty global batch, a plan for other sizes, a sequence longer than the
            CP group's capacity or the model's sliding window, a token id or label outside the
            model's vocabulary, or malformed samples.
    """
    if not is_prepared(model):
        raise RuntimeError(
            f"{type(model).__name__} is not prepared for Skrull (attention "
            f"{getattr(getattr(model, 'config', None), '_attn_implementation', None)!r}); call "
            "lightning_skrull.models.prepare_model(model) first and pass the bare Hugging Face "
            "model (not a DDP wrapper: the engine averages gradients itself)."
        )
    if len(samples) == 0:
        raise ValueError("the global batch has no sample; give at least one.")
    lengths = sample_lengths(samples)
    check_sequence_lengths(model, lengths)
    vocab_size = getattr(text_config(getattr(model, "config", None)), "vocab_size", None)
    if isinstance(vocab_size, int):
        check_token_ids(samples, vocab_size, sample_indices)
    planning = BatchPlanning(
        dp_size=layout.dp_size,
        cp_size=layout.cp_size,
        dp_rank=layout.dp_rank,
        cp_rank=layout.cp_rank,
        bucket_size=bucket_size,
        policy=policy,
        cost_model=cost_model,
    )
    planned = plan_rank_batch(
        samples, planning, plan=plan, lengths=lengths, sample_indices=sample_indices
    )
    plan = planned.plan
    device = _model_device(model)
    batch = planned.rank_batch.to(device)
    if verify_plan and layout.world_size > 1:
        check_same_plan(plan, device, layout.world_group, fingerprint=batch.fingerprint)
    local = forward_backward(model, batch, cp_group=layout.cp_group, backend=backend)
    all_reduce_gradients(model.parameters(), world_size=layout.world_size, group=layout.world_group)
    if layout.world_size > 1:
        dist.all_reduce(local, group=layout.world_group)
    loss = float(local) / layout.world_size
    if not math.isfinite(loss):
        optimizer.zero_grad(set_to_none=True)
        raise FloatingPointError(
            f"the step loss is {loss} over {batch.num_supervised_tokens} supervised tokens; the "
            "optimizer step was skipped on every rank. Lower the learning rate or check the data."
        )
    grad_norm: float | None = None
    if max_grad_norm is not None:
        grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(
        loss=loss,
        num_supervised_tokens=batch.num_supervised_tokens,
        num_micro_batches=len(batch),
        plan=plan,
        grad_norm=grad_norm,
    )


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
