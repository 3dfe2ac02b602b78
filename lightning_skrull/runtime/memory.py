"""Pick the per-rank token budget (``bucket_size``) from measured peak memory.

With packed sequences and memory-efficient attention, activation memory grows linearly with the
number of tokens a rank holds, so peak memory of a training step is well described by
``peak_bytes = alpha * tokens + beta`` (``beta``: weights, gradients, optimizer state, workspace).
The paper profiles ``alpha`` and ``beta`` by hand; here a few probe steps of growing token counts
are measured on the real device (:func:`probe_peak_memory`, CUDA only), the line is fitted by
least squares (:func:`fit_memory_model`, pure) and the largest bucket that stays under a safety
margin is chosen (:func:`choose_bucket_size`, pure).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed import ProcessGroup

from lightning_skrull.data.plan_batch import BatchPlanning, plan_rank_batch
from lightning_skrull.runtime.engine import micro_batch_context
from lightning_skrull.scheduling.plan import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan

AUTO_PROBE_TOKENS = (512, 1024, 2048, 4096)
"""Tokens per rank of the probe steps of ``bucket_size="auto"`` (small, so no probe runs out
of memory on a device that can train the model at all; the fit extrapolates)."""

AUTO_SAFETY_MARGIN = 0.1
"""Share of the device memory ``bucket_size="auto"`` keeps free (allocator fragmentation, fit
error, memory that grows during training)."""

AUTO_MULTIPLE_OF = 128
"""``bucket_size="auto"`` is rounded down to a multiple of this many tokens."""

NONLINEAR_FIT_ERROR = 0.05
"""A fit off by more than this share at a probe point is logged as a warning: memory then grows
faster than linearly in tokens and the extrapolated bucket may not fit."""


@dataclass(frozen=True)
class MemoryFit:
    """A fitted linear memory model ``peak_bytes = alpha * tokens + beta``.

    Attributes:
        alpha: bytes per token held by one rank.
        beta: bytes independent of the token count.
        max_relative_error: largest ``|fit - measured| / measured`` over the probe points.
    """

    alpha: float
    beta: float
    max_relative_error: float

    def predict(self, tokens: int) -> float:
        """Predicted peak bytes for ``tokens`` tokens on one rank."""
        return self.alpha * tokens + self.beta


def fit_memory_model(tokens: Sequence[int], peak_bytes: Sequence[float]) -> MemoryFit:
    """Least-squares fit of ``peak_bytes = alpha * tokens + beta``.

    Args:
        tokens: token counts of the probe steps (at least two distinct values).
        peak_bytes: measured peak memory of each probe step, in bytes.

    Raises:
        ValueError: fewer than two probes, mismatched lengths, fewer than two distinct token
            counts, or a fit whose slope is not positive (memory must grow with tokens).
    """
    if len(tokens) != len(peak_bytes):
        raise ValueError(
            f"Got {len(tokens)} token counts but {len(peak_bytes)} memory readings; "
            "give one peak-memory reading per probe step."
        )
    if len(set(tokens)) < 2:
        raise ValueError(
            f"Memory fitting needs probes at two or more distinct token counts, got {list(tokens)}; "
            "probe with growing token counts."
        )
    n = len(tokens)
    mx = sum(tokens) / n
    my = sum(peak_bytes) / n
    sxx = sum((x - mx) ** 2 for x in tokens)
    sxy = sum((x - mx) * (y - my) for x, y in zip(tokens, peak_bytes))
    alpha = sxy / sxx
    beta = my - alpha * mx
    if alpha <= 0:
        raise ValueError(
            f"Fitted memory slope alpha={alpha:.3g} bytes/token is not positive for tokens "
            f"{list(tokens)} and peaks {list(peak_bytes)}; probe larger token counts so that "
            "activation memory dominates measurement noise."
        )
    err = max(abs(alpha * x + beta - y) / y for x, y in zip(tokens, peak_bytes))
    return MemoryFit(alpha=alpha, beta=beta, max_relative_error=err)


def choose_bucket_size(
    fit: MemoryFit, capacity_bytes: float, *, safety_margin: float = 0.1, multiple_of: int = 128
) -> int:
    """Largest token budget whose predicted peak stays under ``(1 - safety_margin) * capacity``.

    Args:
        fit: the fitted memory model.
        capacity_bytes: device memory available to the process, in bytes.
        safety_margin: share of ``capacity_bytes`` kept free (fragmentation, fit error).
        multiple_of: round the budget down to a multiple of this (attention tile size).

    Raises:
        ValueError: a margin outside [0, 1), or no budget of at least ``multiple_of`` tokens fits.
    """
    if not 0.0 <= safety_margin < 1.0:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin}.")
    if multiple_of < 1:
        raise ValueError(f"multiple_of must be >= 1, got {multiple_of}.")
    usable = (1.0 - safety_margin) * capacity_bytes
    tokens = math.floor((usable - fit.beta) / fit.alpha)
    bucket = (tokens // multiple_of) * multiple_of
    if bucket < multiple_of:
        raise ValueError(
            f"No bucket of at least {multiple_of} tokens fits: the model alone needs "
            f"{fit.beta / 2**30:.2f} GiB of {capacity_bytes / 2**30:.2f} GiB "
            f"(margin {safety_margin:.0%}); use a larger device, ZeRO-2, or a smaller model."
        )
    return bucket


def probe_peak_memory(
    run_step: Callable[[int], None],
    token_counts: Sequence[int],
    *,
    device: torch.device | str | int | None = None,
) -> list[int]:
    """Measure CUDA peak memory of ``run_step(tokens)`` for each token count.

    ``run_step`` must run one full training step (forward, backward, optimizer) on one rank with
    that many tokens. CUDA only: peak memory on the CPU is not measurable this way.

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError(
            "bucket_size='auto' measures CUDA peak memory and needs a GPU; on CPU give "
            "bucket_size as a number of tokens per rank."
        )
    peaks = []
    for tokens in token_counts:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        run_step(tokens)
        torch.cuda.synchronize(device)
        peaks.append(int(torch.cuda.max_memory_allocated(device)))
    return peaks


def auto_bucket_size(
    run_step: Callable[[int], None],
    capacity_bytes: float,
    *,
    token_counts: Sequence[int] = AUTO_PROBE_TOKENS,
    safety_margin: float = AUTO_SAFETY_MARGIN,
    multiple_of: int = AUTO_MULTIPLE_OF,
    measure: Callable[[Callable[[int], None], Sequence[int]], Sequence[float]] | None = None,
) -> tuple[int, MemoryFit]:
    """Probe, fit and choose: the ``bucket_size="auto"`` procedure on one rank.

    Args:
        run_step: one full training step with that many tokens on this rank.
        capacity_bytes: device memory this process may use.
        token_counts: the probe sizes (at least two distinct).
        safety_margin: share of ``capacity_bytes`` kept free.
        multiple_of: round the bucket down to a multiple of this.
        measure: ``measure(run_step, token_counts) -> peak bytes per probe``; default
            :func:`probe_peak_memory` (CUDA).

    Returns:
        ``(bucket_size, fit)``.

    Raises:
        RuntimeError: no CUDA (with the default ``measure``).
        ValueError: the fit or the choice fails (see :func:`fit_memory_model`,
            :func:`choose_bucket_size`).
    """
    measure = probe_peak_memory if measure is None else measure
    peaks = list(measure(run_step, token_counts))
    fit = fit_memory_model(list(token_counts), peaks)
    bucket = choose_bucket_size(
        fit, capacity_bytes, safety_margin=safety_margin, multiple_of=multiple_of
    )
    return bucket, fit


def describe_fit(
    fit: MemoryFit,
    bucket_size: int,
    capacity_bytes: float,
    token_counts: Sequence[int],
    *,
    safety_margin: float = AUTO_SAFETY_MARGIN,
) -> str:
    """One log line: the fitted line, its error, the capacity and the chosen bucket."""
    return (
        f"bucket_size='auto': peak memory = {fit.alpha / 2**10:.1f} KiB/token * tokens + "
        f"{fit.beta / 2**30:.2f} GiB (largest error {fit.max_relative_error:.1%} over probes "
        f"of {list(token_counts)} tokens per rank); {capacity_bytes / 2**30:.2f} GiB usable, "
        f"{safety_margin:.0%} kept free -> bucket_size={bucket_size} tokens per rank "
        f"(predicted peak {fit.predict(bucket_size) / 2**30:.2f} GiB)."
    )


class ProbeStep:
    """One probe training step of ``tokens`` tokens per rank, leaving the model as it was.

    The probe is the worst case for memory at a given bucket: a single sequence of
    ``cp_size * tokens`` tokens distributed over the CP group, so every rank holds ``tokens``
    tokens and gathers the whole sequence's keys and values. Forward and backward run on the
    bare Hugging Face model (no DDP communication; the CP group's attention collectives run, so
    every rank of a CP group must probe together). The optimizer steps with learning rate 0
    and zero gradients, so its state is allocated (and measured) while no parameter changes;
    :meth:`restore` then empties the state and the gradients again.

    Args:
        model: the prepared Hugging Face causal LM.
        optimizer: the training optimizer, or ``None``.
        cp_rank: this process's rank in its CP group.
        cp_size: ranks per CP group.
        cp_group: the CP process group (``None`` when ``cp_size == 1``).
        backend: attention backend.
        device: the model's device.
        vocab_size: token ids are drawn below it.
        autocast: context of the precision plugin around forward and backward.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        cp_rank: int,
        cp_size: int,
        cp_group: ProcessGroup | None,
        backend: str,
        device: torch.device,
        vocab_size: int,
        autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.cp_rank = cp_rank
        self.cp_size = cp_size
        self.cp_group = cp_group
        self.backend = backend
        self.device = device
        self.vocab_size = vocab_size
        self.autocast = autocast

    def __call__(self, tokens: int) -> None:
        length = tokens * self.cp_size
        generator = torch.Generator().manual_seed(tokens)
        ids = torch.randint(0, self.vocab_size, (length,), generator=generator).tolist()
        plan = GlobalBatchPlan(
            micro_batches=((MicroBatchPlan((0,), (DISTRIBUTED,)),),),
            dp_size=1,
            cp_size=self.cp_size,
            bucket_size=tokens,
            policy="probe",
        )
        planning = BatchPlanning(
            dp_size=1, cp_size=self.cp_size, dp_rank=0, cp_rank=self.cp_rank, bucket_size=tokens
        )
        batch = plan_rank_batch([{"input_ids": ids}], planning, plan=plan).rank_batch
        mb = batch.micro_batches[0].to(self.device)
        with micro_batch_context(mb, self.cp_group, self.backend):
            with self.autocast():
                loss = self.model(**mb.inputs).loss
            loss.backward()
        del loss
        if self.optimizer is not None:
            self._step_without_change(self.optimizer)

    @staticmethod
    def _step_without_change(optimizer: torch.optim.Optimizer) -> None:
        saved = []
        for group in optimizer.param_groups:
            lr = group["lr"]
            saved.append(lr.clone() if isinstance(lr, torch.Tensor) else lr)
            if isinstance(lr, torch.Tensor):
                lr.fill_(0.0)
            else:
                group["lr"] = 0.0
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.zero_()
        try:
            optimizer.step()
        finally:
            for group, lr in zip(optimizer.param_groups, saved, strict=True):
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].copy_(lr)
                else:
                    group["lr"] = lr

    def restore(self) -> None:
        """Drop the gradients and the optimizer state the probes created."""
        for p in self.model.parameters():
            p.grad = None
        if self.optimizer is not None:
            self.optimizer.state.clear()


@dataclass(frozen=True, kw_only=True)
class AutoBucket:
    """The outcome of :func:`measure_auto_bucket`: the bucket every rank plans with."""

    bucket_size: int
    """Tokens per rank: the smallest choice over the world."""
    fit: MemoryFit
    """This rank's fitted memory model."""
    capacity_bytes: float
    """Device memory this process may use (free plus what the caching allocator holds)."""

    def describe(self) -> str:
        """One log line: the fitted line, its error, the capacity and the chosen bucket."""
        return describe_fit(self.fit, self.bucket_size, self.capacity_bytes, AUTO_PROBE_TOKENS)

    def nonlinear_warning(self) -> str | None:
        """Why the chosen bucket may not fit, when the fit is off by more than
        :data:`NONLINEAR_FIT_ERROR` at a probe point; ``None`` otherwise."""
        if self.fit.max_relative_error <= NONLINEAR_FIT_ERROR:
            return None
        return (
            f"bucket_size='auto': the linear memory fit is off by "
            f"{100 * self.fit.max_relative_error:.1f}% at a probe point (more than "
            f"{100 * NONLINEAR_FIT_ERROR:.0f}%): memory grows faster than linearly in tokens, "
            "so the chosen bucket may not fit. Give bucket_size explicitly (margin "
            f"{100 * AUTO_SAFETY_MARGIN:.0f}%)."
        )


def measure_auto_bucket(
    probe: ProbeStep, world_group: ProcessGroup | None, world_size: int
) -> AutoBucket:
    """Resolve ``bucket_size="auto"`` from probe steps on this CUDA device.

    Every rank probes (its CP group together), fits ``peak = alpha * tokens + beta`` and
    chooses a bucket (:func:`auto_bucket_size`); the smallest over the world is kept (one
    all-reduce), so every rank plans alike. The probes leave the model and the optimizer as
    they were (:meth:`ProbeStep.restore`).

    Args:
        probe: this rank's probe step (the prepared model, the optimizer, the precision's
            autocast).
        world_group: the group of every rank.
        world_size: ranks in it (no collective with one).
    """
    device = probe.device
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    capacity = free + torch.cuda.memory_reserved(device)
    try:
        bucket, fit = auto_bucket_size(probe, capacity)
    finally:
        probe.restore()
        torch.cuda.empty_cache()
    chosen = torch.tensor([bucket], dtype=torch.int64, device=device)
    if world_size > 1:
        torch.distributed.all_reduce(chosen, op=torch.distributed.ReduceOp.MIN, group=world_group)
    return AutoBucket(bucket_size=int(chosen), fit=fit, capacity_bytes=capacity)
