"""Fit a :class:`CostModel`'s hardware constants to measured iteration times.

The estimated time of an iteration is linear in four unknowns once it is known which CP rank
and which term bound each micro-batch::

    seconds = compute_flops * (1 / achieved_flops)
            + micro_batches * micro_batch_overhead_s
            + collectives   * comm_latency_s            (only where communication is exposed)
            + comm_bytes    * (1 / comm_bandwidth)      (only where communication is exposed)

summed over the micro-batches of the slowest DP rank. :func:`fit_cost_model` alternates between
those two steps: with the current constants it finds, for every sample, the slowest DP rank and
each micro-batch's binding terms; then it solves the linear least-squares problem for the
constants; it repeats until the constants stop changing (at most ``max_rounds`` times).

A constant is only fitted when the samples identify it: a column that is zero in every sample
(no exposed communication, say) or that is a linear combination of the others (every
micro-batch exposes its communication, so latency and overhead move together) keeps its
current value, and so does a constant whose fitted value comes out negative. ``achieved_flops``
and ``micro_batch_overhead_s`` need samples that differ in work per micro-batch and in
micro-batch count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.plan import GlobalBatchPlan
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.simulate import micro_batch_terms


@dataclass(frozen=True)
class FitSample:
    """One measured optimizer step: its plan, the lengths it planned, and its seconds.

    Attributes:
        plan: the plan that ran.
        lengths: the global batch's sequence lengths.
        seconds: measured wall-clock seconds of the step's forward/backward work (the slowest
            DP rank, i.e. what the gradient all-reduce waits for), without the optimizer step.
    """

    plan: GlobalBatchPlan
    lengths: Sequence[int]
    seconds: float


_NAMES = ("achieved_flops", "micro_batch_overhead_s", "comm_latency_s", "comm_bandwidth")


def _features(
    plan: GlobalBatchPlan, lengths: Sequence[int], model: CostModel
) -> tuple[float, float, float, float]:
    """Feature row of one sample under ``model``: the terms of its slowest DP rank."""
    costs = SequenceCosts(lengths, plan.cp_size, model)
    flops_per_second = model.achieved_flops
    best: tuple[float, tuple[float, float, float, float]] = (-1.0, (0.0, 0.0, 0.0, 0.0))
    for mbs in plan.micro_batches:
        seconds, flops, count, coll, nbytes = 0.0, 0.0, 0.0, 0.0, 0.0
        for mb in mbs:
            terms = micro_batch_terms(mb, costs, model)
            seconds += terms.seconds
            flops += terms.compute_seconds * flops_per_second
            count += 1.0
            coll += terms.exposed_collectives
            nbytes += model.comm_bytes(terms.exposed_tokens, plan.cp_size)
        if seconds > best[0]:
            best = (seconds, (flops, count, coll, nbytes))
    return best[1]


def _as_sample(sample: object) -> tuple[GlobalBatchPlan, Sequence[int], float]:
    plan = getattr(sample, "plan", None)
    if plan is not None:
        return plan, sample.lengths, float(sample.seconds)  # type: ignore[attr-defined]
    if isinstance(sample, tuple) and len(sample) == 3:
        return sample[0], sample[1], float(sample[2])
    raise TypeError(
        f"fit samples must be FitSample or (plan, lengths, seconds) tuples, got {sample!r}."
    )


def fit_cost_model(
    model: CostModel,
    samples: Iterable[FitSample | tuple[GlobalBatchPlan, Sequence[int], float]],
    *,
    max_rounds: int = 10,
) -> CostModel:
    """Least-squares fit of the hardware constants of ``model`` to measured iteration times.

    Args:
        model: starting point; its shape, ``tile_size``, ``bytes_per_element`` and
            ``train_flops_factor`` are kept, and so is any constant the samples do not identify.
        samples: measured steps, as :class:`FitSample` or ``(plan, lengths, seconds)``.
        max_rounds: alternations between assigning binding terms and solving.

    Returns:
        A new :class:`CostModel` with the fitted constants.

    Raises:
        ValueError: with fewer than two samples, or a non-positive measured time.
    """
    data = [_as_sample(s) for s in samples]
    if len(data) < 2:
        raise ValueError(
            f"fit needs at least 2 measured steps, got {len(data)}; measure steps that differ "
            "in tokens and in micro-batch count."
        )
    for _, _, seconds in data:
        if not seconds > 0:
            raise ValueError(f"measured seconds={seconds} is invalid; give wall times > 0.")
    y = np.array([s for _, _, s in data], dtype=np.float64)
    current = model
    for _ in range(max_rounds):
        x = np.array([_features(p, lengths, current) for p, lengths, _ in data], dtype=np.float64)
        values = [
            1.0 / current.achieved_flops,
            current.micro_batch_overhead_s,
            current.comm_latency_s,
            1.0 / current.comm_bandwidth,
        ]
        solved = _solve(x, y, values)
        updated = current.with_constants(
            achieved_flops=1.0 / solved[0] if solved[0] > 0 else current.achieved_flops,
            micro_batch_overhead_s=solved[1],
            comm_latency_s=solved[2],
            comm_bandwidth=1.0 / solved[3] if solved[3] > 0 else current.comm_bandwidth,
        )
        if all(
            np.isclose(getattr(updated, n), getattr(current, n), rtol=1e-9, atol=0.0)
            for n in _NAMES
        ):
            return updated
        current = updated
    return current


def _solve(x: np.ndarray, y: np.ndarray, values: list[float]) -> list[float]:
    """Least squares over the identifiable columns, keeping the others at ``values``."""
    scale = np.abs(x).max(axis=0)
    free = [k for k in range(x.shape[1]) if scale[k] > 0]
    out = list(values)
    while free:
        # Drop columns the samples do not separate (the comm columns go first).
        xs = x[:, free] / scale[free]
        if np.linalg.matrix_rank(xs, tol=1e-9) < len(free):
            free.pop()
            continue
        fixed = [k for k in range(x.shape[1]) if k not in free]
        rhs = y - (x[:, fixed] @ np.array([values[k] for k in fixed]) if fixed else 0.0)
        coef, *_ = np.linalg.lstsq(xs, rhs, rcond=None)
        coef = coef / scale[free]
        negative = [k for k, c in zip(free, coef, strict=True) if c < 0]
        if negative:
            free.remove(negative[-1])
            continue
        for k, c in zip(free, coef, strict=True):
            out[k] = float(c)
        return out
    return out
