"""docs/precision.md's rule for 16-bit runs, and the dense model's single-process references.

A 16-bit run is judged by its update (parameters after less before, flattened): its
:func:`relative_distance` to the float32 reference's update is at most :data:`RATIO` x the same
distance of a single-process reference in the run's dtypes, plus :data:`FLOOR`. The references of
the dense model (:class:`~helpers.PlainLM`'s) in each precision are :func:`reference_run` and
:func:`precision_reference`; tests/strategies/test_precision_matrix.py holds the 4-rank cells.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np
import torch
from helpers import GLOBAL_BATCH, LR, float64_params, make_data, reference_model, token_loss_sum

Run = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]
"""``(parameters before, after)`` of a training run."""

STEPS = 2
"""Global batches of :func:`precision_reference` (those of tests/strategies/test_precision_matrix.py's
cells)."""

# 16-bit: relative distance of a cell's update to the float32 reference's update, at most
# RATIO x the same distance of the single-process reference in the cell's precision, plus FLOOR.
# Measured (cell / reference): DDP bf16-mixed 3.7e-3 / 4.6e-3, DDP bf16-true 2.48e-2 / 2.49e-2,
# ZeRO-2 bf16-mixed 1.97e-2 / 1.97e-2, ZeRO-2 bf16-true 1.97e-2 / 1.97e-2: the cells are no
# farther from float32 than their references (ratios 0.81 to 1.00). The cells sum in another
# order (packed micro-batches, shards, reductions over 4 ranks), and in bf16 the order alone
# matters: reversing the sequences inside each global batch, nothing else changed, moves the
# single-process 16-bit updates by 4.2e-3 (bf16-mixed) to 1.1e-2 (bf16-true) relative to the
# float32 update, and each cell lies about that far from its reference (4.0e-3 to 1.2e-2).
# RATIO = 2 leaves room for that order noise on top of the reference's own rounding; FLOOR, a
# quarter of the smallest such order effect, keeps the bound from collapsing should a reference
# land near the float32 update by chance. Bounds: 1.0e-2 (DDP bf16-mixed), 5.1e-2 (DDP
# bf16-true), 4.0e-2 (ZeRO-2). A cell's update scaled by 1.05 would be at 5.0e-2 to 5.6e-2:
# a gradient 5% off fails every cell.
RATIO = 2.0
FLOOR = 1e-3

# GradScaler's default initial scale; no step of the plain fp16 run overflows at it (asserted)
INIT_SCALE = 2.0**16


def update(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> np.ndarray:
    """Parameters after minus before, all parameters in one flat vector."""
    assert before.keys() == after.keys()
    return np.concatenate([(after[k] - before[k]).ravel() for k in sorted(after)])


def relative_distance(delta: np.ndarray, delta_fp32: np.ndarray) -> float:
    """``||delta - delta_fp32|| / ||delta_fp32||``."""
    return float(np.linalg.norm(delta - delta_fp32) / np.linalg.norm(delta_fp32))


class InfiniteGradient(torch.autograd.Function):
    """The identity forward; its backward multiplies the incoming gradient by ``inf``: what an
    fp16 overflow in that micro-batch's backward leaves in the gradients."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("inf")


@dataclasses.dataclass(frozen=True)
class ReferenceRun:
    """A reference's parameters before training and after each step, and for ``fp16_autocast``
    the loss scale after each step."""

    before: dict[str, np.ndarray]
    steps: list[dict[str, np.ndarray]]
    scales: list[float]
    norms: list[float] = dataclasses.field(default_factory=list)
    """With ``clip``: each step's gradient norm before clipping (unscaled)."""

    @property
    def after(self) -> dict[str, np.ndarray]:
        return self.steps[-1]


def precision_reference(kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(parameters before, after)`` of plain HF training of ``STEPS`` global batches.

    ``kind``: ``"float32"``; ``"autocast"`` (float32 model, bf16 autocast forward); ``"bf16"``
    (the whole model in bf16, SGD on the bf16 parameters); ``"bf16_fp32_master"`` (the whole
    model in bf16, SGD on a float32 copy of the parameters that is copied back after each step);
    ``"bf16_params_fp32_master"`` (the same with the parameters cast, the buffers left float32);
    ``"fp16_autocast"`` (float32 model, fp16 autocast forward, a GradScaler).
    ``"float32@bf16"`` and ``"autocast@bf16"``: ``"float32"`` and ``"autocast"`` started from
    the initial parameters rounded to bf16 (a bf16 checkpoint's); ``"bf16_params_autocast"``:
    from the same start, the parameters kept in bf16 (the buffers float32), the forward under
    bf16 autocast and SGD on the bf16 parameters.
    """
    run = reference_run(kind, STEPS)
    return run.before, run.after


@functools.cache
def reference_run(
    kind: str,
    steps: int,
    skipped: frozenset[int] = frozenset(),
    device: str = "cpu",
    clip: float | None = None,
) -> ReferenceRun:
    """The reference of ``kind`` over ``steps`` global batches on ``device``; in the steps
    ``skipped`` the loss gets an infinite gradient under ``"fp16_autocast"`` (the scaler then
    skips the step and lowers the scale), and no update under the other kinds (the same skip,
    by hand); ``clip``: the gradient's norm clipped to it after unscaling, before each step
    (``"float32"`` and ``"fp16_autocast"`` only)."""
    threads = torch.get_num_threads()
    # one thread, as each spawned rank runs: these tiny ops gain nothing from two, and on a
    # busy machine the second thread's waits made the references 10x slower
    torch.set_num_threads(1)
    try:
        return _train_reference(kind, steps, skipped, device, clip)
    finally:
        torch.set_num_threads(threads)


def _train_reference(
    kind: str,
    steps: int,
    skipped: frozenset[int],
    device: str = "cpu",
    clip: float | None = None,
) -> ReferenceRun:
    assert clip is None or kind in ("float32", "fp16_autocast"), kind
    data = make_data(GLOBAL_BATCH * steps)
    model = reference_model().to(device)
    if kind in ("bf16", "bf16_fp32_master"):
        model.to(torch.bfloat16)
    elif kind in ("bf16_params_fp32_master", "bf16_params_autocast"):
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    elif kind.endswith("@bf16"):
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
        kind = kind.removesuffix("@bf16")
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params] if "master" in kind else None
    optimizer = torch.optim.SGD(master if master is not None else params, lr=LR)
    scaler = torch.amp.GradScaler(device, init_scale=INIT_SCALE, enabled=kind == "fp16_autocast")
    autocast_dtype = {
        "autocast": torch.bfloat16,
        "bf16_params_autocast": torch.bfloat16,
        "fp16_autocast": torch.float16,
    }.get(kind)
    run = ReferenceRun(float64_params(model), [], [])
    for step in range(steps):
        total, tokens = torch.zeros((), device=device), 0
        with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            for sample in data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]:
                loss, n = token_loss_sum(model, sample)
                total, tokens = total + loss, tokens + n
        loss = total / tokens
        if step in skipped and not scaler.is_enabled():
            run.steps.append(float64_params(model))
            continue
        if step in skipped:
            loss = InfiniteGradient.apply(loss)
        for p in params:
            p.grad = None
        scaler.scale(loss).backward()
        if master is not None:
            for m, p in zip(master, params, strict=True):
                m.grad = p.grad.float()
        scaler.unscale_(optimizer)  # once: the same as Lightning's plugin does before clipping
        if clip is not None:
            run.norms.append(float(torch.nn.utils.clip_grad_norm_(params, clip)))
        scaler.step(optimizer)  # a plain optimizer.step() when the scaler is disabled
        scaler.update()
        if master is not None:
            with torch.no_grad():
                for m, p in zip(master, params, strict=True):
                    p.copy_(m)
        run.steps.append(float64_params(model))
        if scaler.is_enabled():
            run.scales.append(scaler.get_scale())
    return run
