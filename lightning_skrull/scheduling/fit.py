"""Fit a :class:`CostModel`'s hardware constants to measured iteration times.

The estimated time of an iteration is linear in four unknowns (five with
``fit_per_sequence=True``, which adds ``sequences * per_sequence_seconds``) once it is known
which CP rank and which term bound each micro-batch::

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
from lightning_skrull.scheduling.simulate import MicroBatchTerms, micro_batch_terms


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

FEATURES = (
    "achieved_flops",
    "micro_batch_overhead_s",
    "comm_latency_s",
    "comm_bandwidth",
    "per_sequence_seconds",
)
"""The constants of a feature row, in order; the unknowns are ``1 / achieved_flops``,
``micro_batch_overhead_s``, ``comm_latency_s``, ``1 / comm_bandwidth`` and
``per_sequence_seconds`` (each row's time is the dot product of the two)."""


def micro_batch_features(
    terms: MicroBatchTerms, model: CostModel, cp_size: int
) -> tuple[float, float, float, float, float]:
    """Feature row of one micro-batch's terms (see :data:`FEATURES`): its compute FLOPs
    (training, the slowest rank's critical path), 1 (its overhead), its exposed collectives,
    its exposed bytes and the sequences its slowest rank holds."""
    return (
        terms.compute_seconds * model.achieved_flops,
        1.0,
        float(terms.exposed_collectives),
        model.comm_bytes(terms.exposed_tokens, cp_size),
        float(terms.sequences),
    )


def unknowns(model: CostModel) -> list[float]:
    """The values of the unknowns of :data:`FEATURES` under ``model``."""
    return [
        1.0 / model.achieved_flops,
        model.micro_batch_overhead_s,
        model.comm_latency_s,
        1.0 / model.comm_bandwidth,
        model.per_sequence_seconds,
    ]


def with_unknowns(model: CostModel, values: Sequence[float]) -> CostModel:
    """``model`` with the unknowns of :data:`FEATURES` set to ``values`` (a non-positive
    reciprocal keeps its constant)."""
    flops, overhead, latency, inverse_bandwidth, per_sequence = values
    return model.with_constants(
        achieved_flops=1.0 / flops if flops > 0 else model.achieved_flops,
        micro_batch_overhead_s=overhead,
        comm_latency_s=latency,
        comm_bandwidth=1.0 / inverse_bandwidth if inverse_bandwidth > 0 else model.comm_bandwidth,
        per_sequence_seconds=per_sequence,
    )


def _features(plan: GlobalBatchPlan, lengths: Sequence[int], model: CostModel) -> tuple[float, ...]:
    """Feature row of one sample under ``model``: the terms of its slowest DP rank."""
    costs = SequenceCosts(lengths, plan.cp_size, model)
    best: tuple[float, tuple[float, ...]] = (-1.0, (0.0,) * len(FEATURES))
    for mbs in plan.micro_batches:
        seconds = 0.0
        row = [0.0] * len(FEATURES)
        for mb in mbs:
            terms = micro_batch_terms(mb, costs, model)
            seconds += terms.seconds
            for k, value in enumerate(micro_batch_features(terms, model, plan.cp_size)):
                row[k] += value
        if seconds > best[0]:
            best = (seconds, tuple(row))
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
    fit_per_sequence: bool = False,
) -> CostModel:
    """Least-squares fit of the hardware constants of ``model`` to measured iteration times.

    Args:
        model: starting point; its shape, ``tile_size``, ``bytes_per_element`` and
            ``train_flops_factor`` are kept, and so is any constant the samples do not identify.
        samples: measured steps, as :class:`FitSample` or ``(plan, lengths, seconds)``.
        max_rounds: alternations between assigning binding terms and solving.
        fit_per_sequence: also fit ``per_sequence_seconds`` (from the sequences the slowest
            ranks hold); by default it keeps its value.

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
    used = len(FEATURES) if fit_per_sequence else len(_NAMES)
    current = model
    for _ in range(max_rounds):
        x = np.array([_features(p, lengths, current) for p, lengths, _ in data], dtype=np.float64)
        values = unknowns(current)
        solved = _solve(x[:, :used], y - x[:, used:] @ np.array(values[used:]), values[:used])
        updated = with_unknowns(current, solved + values[used:])
        if all(
            np.isclose(getattr(updated, n), getattr(current, n), rtol=1e-9, atol=0.0)
            for n in FEATURES
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
