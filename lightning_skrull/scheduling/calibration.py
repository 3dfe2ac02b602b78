"""Online calibration: refit a :class:`CostModel`'s constants to the micro-batches a run measures.

:class:`OnlineCalibrator` takes, step after step, a plan, its lengths and the measured seconds of
every planned micro-batch (forward + backward, the slowest CP rank of each), and refits the
hardware constants of :meth:`CostModel.rank_seconds`. Every micro-batch is one row of the linear
problem :mod:`~lightning_skrull.scheduling.fit` sets up (:func:`micro_batch_features`)::

    seconds = compute_flops * (1 / achieved_flops) + 1 * micro_batch_overhead_s
            + exposed_collectives * comm_latency_s + exposed_bytes * (1 / comm_bandwidth)
            + sequences * per_sequence_seconds

Which terms a micro-batch exposes depends on the constants, so a refit alternates (at most
``max_rounds`` times) between assigning the terms under the current constants and solving.

The fit is built for measurements taken while training:

* **Relative errors.** Each row is divided by its measured time, so a long micro-batch does not
  outweigh many short ones and noise proportional to the time weighs the same everywhere.
* **Robust.** Huber weights by iteratively reweighted least squares, with the scale from the
  median absolute deviation of the residuals: a handful of outliers (a page fault, a
  checkpoint write) get little weight, however large they are.
* **Only what the data identifies.** A column that is zero in every row, or that the columns
  before it explain to within ``identifiable`` of its norm (one sequence per micro-batch makes
  the per-sequence column equal the overhead's), keeps its constant; so does a constant whose
  fitted value comes out negative.
* **Bounded.** One refit moves a constant by at most ``max_ratio`` either way; a constant at 0
  may grow to at most the value at which its term alone explains a typical micro-batch.
* **Adopted when better.** The refitted model replaces the current one only when its median
  log error (``|log(predicted / measured)|``) on the observed rows is lower by
  ``min_improvement`` (and by a tenth of the current one), so measurement noise does not make the
  plans churn. The log error, unlike the relative one, keeps improving with each bounded step of
  a model that predicts far too little (an H100's FLOP/s on a CPU).
* **The same on every rank.** Fitted constants are rounded to 9 significant digits, so ranks that
  fit the same rows agree even where their BLAS differs in the last bits.
* **No warm-up.** Any number of rows refits what they identify; the window keeps the newest
  ``window`` rows (whole steps).

:class:`CostModelSchedule` records which adopted model plans which global batch, so every rank
plans every batch with the same one.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.fit import FEATURES, micro_batch_features, unknowns, with_unknowns
from lightning_skrull.scheduling.plan import GlobalBatchPlan
from lightning_skrull.scheduling.sequence_costs import SequenceCosts
from lightning_skrull.scheduling.simulate import micro_batch_terms

HUBER_K = 1.345
"""Huber's threshold in robust standard deviations (95% efficiency under Gaussian noise)."""

PRIORITY = (0, 1, 3, 2, 4)
"""The order in which :data:`FEATURES` columns claim what the data explains: compute, overhead,
bandwidth, latency, per-sequence. A later column that the earlier ones explain keeps its
constant."""


@dataclass(frozen=True)
class _Step:
    plan: GlobalBatchPlan
    lengths: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]
    rows: int


def _round(value: float) -> float:
    return float(f"{value:.9g}")


def _apply(model: CostModel, values: Sequence[float]) -> CostModel:
    """``model`` with the unknowns that changed set to ``values`` (constants rounded to 9
    significant digits); the others keep their exact constant."""
    solved = with_unknowns(model, values)
    constants = {
        name: _round(getattr(solved, name))
        for name, old, new in zip(FEATURES, unknowns(model), values, strict=True)
        if new != old
    }
    return model.with_constants(**constants) if constants else model


class OnlineCalibrator:
    """Refits a cost model's constants to measured micro-batch times.

    Args:
        cost_model: the starting model; its shape, tile size, bytes per element and training
            FLOP factor are kept.
        window: newest micro-batch rows kept for the fit (whole steps; the newest step is
            always kept).
        max_ratio: the most one refit multiplies or divides a constant by (> 1).
        min_improvement: the least drop of the median log prediction error
            (``|log(predicted / measured)|``) for a refitted model to be adopted (0 adopts every
            refit).
        identifiable: least share of a column's norm the earlier columns must leave unexplained
            for its constant to be fitted.
        max_rounds: alternations of term assignment and solving per refit.
        fit_per_sequence: fit ``per_sequence_seconds`` (else it keeps its value).

    Raises:
        TypeError: ``cost_model`` is not a :class:`CostModel`.
        ValueError: an option out of range.
    """

    def __init__(
        self,
        cost_model: CostModel,
        *,
        window: int = 4096,
        max_ratio: float = 2.0,
        min_improvement: float = 0.005,
        identifiable: float = 0.01,
        max_rounds: int = 4,
        fit_per_sequence: bool = True,
    ) -> None:
        if not isinstance(cost_model, CostModel):
            raise TypeError(f"OnlineCalibrator needs a CostModel, got {type(cost_model).__name__}.")
        if not (isinstance(window, int) and window >= 1):
            raise ValueError(f"window={window!r} is invalid; give an int >= 1 (rows kept).")
        if not max_ratio > 1.0 or math.isinf(max_ratio):
            raise ValueError(f"max_ratio={max_ratio!r} is invalid; give a finite number > 1.")
        if not min_improvement >= 0.0:
            raise ValueError(f"min_improvement={min_improvement!r} is invalid; give a number >= 0.")
        if not 0.0 < identifiable < 1.0:
            raise ValueError(f"identifiable={identifiable!r} is invalid; give a number in (0, 1).")
        if not (isinstance(max_rounds, int) and max_rounds >= 1):
            raise ValueError(f"max_rounds={max_rounds!r} is invalid; give an int >= 1.")
        self._model = cost_model
        self._window = window
        self._max_ratio = float(max_ratio)
        self._min_improvement = float(min_improvement)
        self._identifiable = float(identifiable)
        self._max_rounds = max_rounds
        self._fitted = len(FEATURES) if fit_per_sequence else len(FEATURES) - 1
        self._steps: deque[_Step] = deque()
        self._rows = 0
        self._pending = False
        self._refits = 0
        self._adopted = 0
        self._error: float | None = None

    # ------------------------------------------------------------------ public
    @property
    def cost_model(self) -> CostModel:
        """The current model, refitted first when steps were observed since the last refit."""
        if self._pending:
            self.refit()
        return self._model

    @property
    def refits(self) -> int:
        """Refits run so far."""
        return self._refits

    @property
    def adopted(self) -> int:
        """Refits whose model was adopted."""
        return self._adopted

    @property
    def prediction_error(self) -> float | None:
        """Median relative error ``|predicted - measured| / measured`` of the current model on the
        observed micro-batches at the last refit (``None`` before the first)."""
        return self._error

    @property
    def observed_rows(self) -> int:
        """Micro-batch measurements in the window."""
        return self._rows

    def observations(self) -> list[tuple[GlobalBatchPlan, tuple[int, ...], float]]:
        """Every measured micro-batch in the window, one ``(plan, lengths, seconds)`` each.

        ``plan`` is a plan of one DP rank holding only that micro-batch, so each can be given
        to :func:`~lightning_skrull.scheduling.fit.fit_cost_model` as a sample of its own
        (an offline fit over the same rows the online one uses).
        """
        out = []
        for step in self._steps:
            for mbs, measured in zip(step.plan.micro_batches, step.seconds, strict=True):
                for mb, v in zip(mbs, measured, strict=True):
                    if math.isfinite(v):
                        one = dataclasses.replace(step.plan, micro_batches=((mb,),), dp_size=1)
                        out.append((one, step.lengths, v))
        return out

    def error_of(self, model: CostModel) -> float | None:
        """Median relative error ``|predicted - measured| / measured`` of ``model`` on the
        micro-batches in the window (``None`` before any was observed)."""
        if not self._steps:
            return None
        return _median_error(self._design(model), self._measured(), unknowns(model))

    def observe(
        self,
        plan: GlobalBatchPlan,
        lengths: Sequence[int],
        micro_batch_seconds: Sequence[Sequence[float]],
    ) -> None:
        """Record one step's measurements; the next read of :attr:`cost_model` refits.

        Args:
            plan: the plan that ran.
            lengths: the lengths it was planned from.
            micro_batch_seconds: ``micro_batch_seconds[dp_rank][i]``: measured forward +
                backward seconds of planned micro-batch ``i`` of that DP rank (its slowest CP
                rank). A non-finite value (NaN: not measured) leaves that micro-batch out.

        Raises:
            TypeError: ``plan`` is not a :class:`GlobalBatchPlan`.
            ValueError: the shape does not match the plan, or a time is not > 0.
        """
        if not isinstance(plan, GlobalBatchPlan):
            raise TypeError(f"plan must be a GlobalBatchPlan, got {type(plan).__name__}.")
        if len(micro_batch_seconds) != plan.dp_size:
            raise ValueError(
                f"micro_batch_seconds has {len(micro_batch_seconds)} DP ranks, the plan "
                f"{plan.dp_size}; give one list per DP rank."
            )
        rows = 0
        seconds: list[tuple[float, ...]] = []
        for d, (measured, mbs) in enumerate(
            zip(micro_batch_seconds, plan.micro_batches, strict=True)
        ):
            if len(measured) != len(mbs):
                raise ValueError(
                    f"DP rank {d} has {len(measured)} measured micro-batches, the plan gives it "
                    f"{len(mbs)}; time the planned micro-batches only (not padding ones)."
                )
            values = tuple(float(v) for v in measured)
            for i, v in enumerate(values):
                if math.isfinite(v):
                    if not v > 0:
                        raise ValueError(
                            f"micro_batch_seconds[{d}][{i}]={v} is invalid; give seconds > 0 "
                            "(or NaN for a micro-batch not measured)."
                        )
                    rows += 1
            seconds.append(values)
        if not rows:
            return
        self._steps.append(_Step(plan, tuple(int(s) for s in lengths), tuple(seconds), rows))
        self._rows += rows
        while self._rows - self._steps[0].rows >= self._window:
            self._rows -= self._steps.popleft().rows
        self._pending = True

    def refit(self) -> CostModel:
        """Refit on the observed window now and return the (possibly unchanged) current model."""
        self._pending = False
        if not self._steps:
            return self._model
        self._refits += 1
        start = self._model
        y = self._measured()
        candidate = start
        lower, upper = self._bounds(unknowns(start), y)
        for _ in range(self._max_rounds):
            x = self._design(candidate)
            solved = _robust_solve(
                x, y, unknowns(candidate), self._fitted, self._identifiable, lower, upper
            )
            updated = _apply(candidate, solved)
            if updated == candidate:
                break
            candidate = updated
        x_old, x_new = self._design(start), self._design(candidate)
        old = _median_log_error(x_old, y, unknowns(start))
        new = _median_log_error(x_new, y, unknowns(candidate))
        needed = max(self._min_improvement, 0.1 * old) if self._min_improvement > 0 else 0.0
        if candidate != start and old - new > needed:
            self._model = candidate
            self._adopted += 1
            self._error = _median_error(x_new, y, unknowns(candidate))
        else:
            self._error = _median_error(x_old, y, unknowns(start))
        return self._model

    # ------------------------------------------------------------------ internals
    def _measured(self) -> np.ndarray:
        values = [
            v for step in self._steps for ranks in step.seconds for v in ranks if math.isfinite(v)
        ]
        return np.array(values, dtype=np.float64)

    def _design(self, model: CostModel) -> np.ndarray:
        """Feature rows of every measured micro-batch in the window, under ``model``."""
        rows: list[tuple[float, ...]] = []
        for step in self._steps:
            cp_size = step.plan.cp_size
            costs = SequenceCosts(step.lengths, cp_size, model)
            for mbs, measured in zip(step.plan.micro_batches, step.seconds, strict=True):
                for mb, v in zip(mbs, measured, strict=True):
                    if math.isfinite(v):
                        terms = micro_batch_terms(mb, costs, model)
                        rows.append(micro_batch_features(terms, model, cp_size))
        return np.array(rows, dtype=np.float64)

    def _bounds(self, start: Sequence[float], y: np.ndarray) -> tuple[list[float], list[float]]:
        """Per unknown, ``[start / max_ratio, start * max_ratio]``; from 0, up to the value at
        which its term alone takes the median micro-batch's time, measured with ``start``'s
        terms (the first round's design)."""
        x = self._design(self._model)
        r = self._max_ratio
        lower, upper = [], []
        for k, s in enumerate(start):
            if s > 0:
                lower.append(s / r)
                upper.append(s * r)
                continue
            used = x[:, k] > 0
            lower.append(0.0)
            upper.append(float(np.median(y[used] / x[used, k])) if used.any() else 0.0)
        return lower, upper


def _median_error(x: np.ndarray, y: np.ndarray, values: Sequence[float]) -> float:
    predicted = x @ np.asarray(values, dtype=np.float64)
    return float(np.median(np.abs(predicted - y) / y))


def _median_log_error(x: np.ndarray, y: np.ndarray, values: Sequence[float]) -> float:
    """Median ``|log(predicted / measured)|``: how many e-folds the model is off. Unlike the
    relative error, which saturates at 1 for a model that predicts far too little, it keeps
    rewarding a bounded step towards the data however far off the model starts."""
    predicted = np.maximum(x @ np.asarray(values, dtype=np.float64), 1e-12)
    return float(np.median(np.abs(np.log(predicted / y))))


def _identified(a: np.ndarray, candidates: Sequence[int], tol: float) -> list[int]:
    """The columns of ``a`` (in :data:`PRIORITY` order) that the earlier chosen ones leave at
    least ``tol`` of their norm unexplained."""
    chosen: list[int] = []
    basis: list[np.ndarray] = []
    for k in PRIORITY:
        if k not in candidates:
            continue
        col = a[:, k]
        norm = float(np.linalg.norm(col))
        if norm == 0.0:
            continue
        rest = col.copy()
        for q in basis:
            rest -= (q @ rest) * q
        left = float(np.linalg.norm(rest))
        if left > tol * norm:
            chosen.append(k)
            basis.append(rest / left)
    return sorted(chosen)


def _huber_lstsq(cols: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """Huber-weighted least squares by iteratively reweighted least squares (MAD scale)."""
    scale = np.abs(cols).max(axis=0)
    cols = cols / scale
    weights = np.ones(len(rhs))
    coef = np.zeros(cols.shape[1])
    for _ in range(30):
        root = np.sqrt(weights)
        coef_new, *_ = np.linalg.lstsq(cols * root[:, None], rhs * root, rcond=None)
        residual = rhs - cols @ coef_new
        mad = float(np.median(np.abs(residual - np.median(residual))))
        spread = max(1.4826 * mad, 1e-9)
        size = np.maximum(np.abs(residual), 1e-300)
        weights = np.minimum(1.0, HUBER_K * spread / size)
        done = np.allclose(coef_new, coef, rtol=1e-10, atol=0.0)
        coef = coef_new
        if done:
            break
    return coef / scale


def _robust_solve(
    x: np.ndarray,
    y: np.ndarray,
    values: Sequence[float],
    fitted: int,
    tol: float,
    lower: Sequence[float],
    upper: Sequence[float],
) -> list[float]:
    """Huber-weighted least squares of relative errors over the identifiable unknowns, within
    ``[lower, upper]``; the others keep ``values``.

    A coefficient outside its bounds is fixed at the bound it crossed (the one that crossed
    farthest first) and the rest are solved again, so that the bound on one constant does not
    leave the others where the unbounded solution put them.
    """
    a = x / y[:, None]
    out = list(values)
    free = _identified(a, range(fitted), tol)
    while free:
        fixed = [k for k in range(len(out)) if k not in free]
        rhs = 1.0 - a[:, fixed] @ np.array([out[k] for k in fixed])
        coef = _huber_lstsq(a[:, free], rhs)
        worst, where, bound = 0.0, -1, 0.0
        for k, c in zip(free, coef, strict=True):
            lo, hi = lower[k], upper[k]
            width = max(hi - lo, 1e-300)
            miss = (lo - c) / width if c < lo else (c - hi) / width if c > hi else 0.0
            if miss > worst:
                worst, where, bound = miss, k, (lo if c < lo else hi)
        if where >= 0:
            out[where] = bound
            free.remove(where)
            continue
        for k, c in zip(free, coef, strict=True):
            out[k] = float(c)
        return out
    return out


class CostModelSchedule:
    """Which cost model plans which training global batch.

    Online calibration adopts a refitted model during a step; it takes effect from a later
    global batch, the same on every rank, so every rank plans every batch alike. A position is
    ``(epoch, index)``, compared in that order; the model of a batch is the last one adopted
    from a position at or before it.

    Args:
        cost_model: the model of every batch until another is adopted.
    """

    def __init__(self, cost_model: CostModel) -> None:
        self._entries: list[tuple[tuple[int, int], CostModel]] = [((-1, -1), cost_model)]

    @property
    def latest(self) -> CostModel:
        """The most recently adopted model."""
        return self._entries[-1][1]

    def model_for(self, epoch: int, index: int) -> CostModel:
        """The model that plans global batch ``index`` of ``epoch``."""
        position = (epoch, index)
        for start, model in reversed(self._entries):
            if start <= position:
                return model
        return self._entries[0][1]

    def adopt(self, cost_model: CostModel, epoch: int, index: int) -> None:
        """Plan with ``cost_model`` from global batch ``index`` of ``epoch`` on.

        Raises:
            ValueError: the position is before the last adoption's.
        """
        position = (epoch, index)
        if position < self._entries[-1][0]:
            raise ValueError(
                f"a cost model adopted from batch {position} cannot precede the last one, "
                f"adopted from {self._entries[-1][0]}; adopt in step order."
            )
        self._entries.append((position, cost_model))
        del self._entries[:-8]  # older entries plan batches long trained

    def state_dict(self) -> list[dict[str, Any]]:
        """The entries as plain data (positions and every constant)."""
        return [
            {"epoch": e, "index": i, "cost_model": dataclasses.asdict(m)}
            for (e, i), m in self._entries
        ]

    def load_state_dict(self, state: Sequence[Mapping[str, Any]]) -> None:
        """Restore entries saved by :meth:`state_dict`."""
        entries = []
        for entry in state:
            model = CostModel.from_dict(entry["cost_model"])
            entries.append(((int(entry["epoch"]), int(entry["index"])), model))
        if not entries:
            raise ValueError("a saved cost-model schedule needs at least one entry.")
        self._entries = entries
