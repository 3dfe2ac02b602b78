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
from dataclasses import dataclass


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
    run_step: Callable[[int], None], token_counts: Sequence[int], *, device: object = None
) -> list[int]:
    """Measure CUDA peak memory of ``run_step(tokens)`` for each token count.

    ``run_step`` must run one full training step (forward, backward, optimizer) on one rank with
    that many tokens. CUDA only: peak memory on the CPU is not measurable this way.

    Raises:
        RuntimeError: CUDA is not available.
    """
    import torch

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
