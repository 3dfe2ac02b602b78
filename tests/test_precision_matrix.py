"""Trainer.fit in every precision on both Skrull strategies equals plain HF in that precision.

The matrix {"32-true", "bf16-mixed", "bf16-true"} x {SkrullStrategy, SkrullZero2Strategy} runs
at DP=2 x CP=2 on 4 gloo processes, all six cells in one spawn (each process start costs
seconds), 2 SGD steps each on the same global batches (dataset order). docs/precision.md tells
what each cell runs in and why its reference is what it is.

Every reference is independent of the package: a plain Hugging Face model with eager attention
on one process, one sequence at a time, the summed token cross-entropy divided by the global
batch's supervised tokens, then SGD, in the precision the cell trains in.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
import torch
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    LR,
    BatchRecorder,
    PlainLM,
    cpu_trainer,
    make_data,
    max_diff,
    reference_model,
    token_loss_sum,
)

from lightning_skrull.runtime.launch import spawn

STEPS = 2
# make_data(NUM_SAMPLES): at DP=2 x CP=2 and BUCKET tokens per CP rank, the planner gives the two
# DP ranks 3 and 3 micro-batches in step 0 and 2 and 3 in step 1.
NUM_SAMPLES = GLOBAL_BATCH * STEPS
PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
STRATEGIES = ("ddp", "zero2")

# 32-true: the packed, sharded run sums the same float32 token terms in another order than the
# one-sequence-at-a-time reference, and DDP / ZeRO-2 average gradients over 4 ranks; parameters
# after 2 SGD steps of lr 0.5 agree to float32 rounding (measured max difference 7.5e-9 under
# DDP, 6.0e-8 under ZeRO-2).
PARAM_ATOL = 1e-5
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


def _params(model: torch.nn.Module) -> dict[str, np.ndarray]:
    """Every parameter as float64 (exact for bf16 and float32 values)."""
    return {k: v.detach().double().numpy().copy() for k, v in model.named_parameters()}


# ----------------------------------------------------------------------------- 4 ranks
class Recorder(BatchRecorder):
    """Records the parameters the run starts from and, per step, the micro-batch counts."""

    def __init__(self) -> None:
        super().__init__()
        self.before: dict[str, np.ndarray] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        # after the strategy and the precision plugin cast the model
        self.before = _params(module.model)


def _fit_cell(strategy_name: str, precision: str) -> dict[str, Any]:
    from lightning_skrull import SkrullDataModule, SkrullStrategy, SkrullZero2Strategy

    strategy_class = SkrullStrategy if strategy_name == "ddp" else SkrullZero2Strategy
    recorder = Recorder()
    trainer = cpu_trainer(
        strategy_class(cp_size=2, bucket_size=BUCKET),
        precision=precision,
        max_steps=STEPS,
        callbacks=[recorder],
    )
    module = PlainLM()
    data = SkrullDataModule(
        train_data=make_data(NUM_SAMPLES), global_batch_size=GLOBAL_BATCH, shuffle=False
    )
    trainer.fit(module, data)
    return {
        "before": recorder.before,
        "after": _params(module.model),
        "dtype": str(next(module.model.parameters()).dtype),
        "buffer_dtypes": sorted({str(b.dtype) for b in module.model.buffers()}),
        "steps": recorder.steps,
    }


def _matrix(rank: int, world_size: int) -> dict[tuple[str, str], dict[str, Any]]:
    return {(s, p): _fit_cell(s, p) for s in STRATEGIES for p in PRECISIONS}


# ----------------------------------------------------------------------------- reference
# The reference of each cell (a kind of reference_training).
REFERENCES = {
    # float32 model, float32 gradients and SGD
    ("ddp", "32-true"): "float32",
    ("zero2", "32-true"): "float32",
    # Lightning's MixedPrecision: float32 parameters, forward under torch.autocast("cpu",
    # bfloat16), float32 gradients and SGD
    ("ddp", "bf16-mixed"): "autocast",
    # Lightning's HalfPrecision: model.to(bfloat16) (parameters and buffers); gradients and SGD
    # in bfloat16
    ("ddp", "bf16-true"): "bf16",
    # DeepSpeed bf16.enabled (Lightning maps both 16-bit settings to it and does not autocast):
    # the engine casts the parameters, not the buffers, to bfloat16 (the rotary inv_freq stays
    # float32); bfloat16 forward and backward; ZeRO-2 keeps a float32 master copy made from the
    # bfloat16 parameters, steps SGD on it with the bfloat16 gradients upcast, and copies it
    # back to the bfloat16 parameters
    ("zero2", "bf16-mixed"): "bf16_params_fp32_master",
    # the same, but Lightning's DeepSpeedPrecision first casts the whole module (buffers too)
    ("zero2", "bf16-true"): "bf16_fp32_master",
}


@functools.cache
def reference_training(kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(parameters before, after)`` of plain HF training of ``STEPS`` global batches.

    ``kind``: ``"float32"``; ``"autocast"`` (float32 model, bf16 autocast forward); ``"bf16"``
    (the whole model in bf16, SGD on the bf16 parameters); ``"bf16_fp32_master"`` (the whole
    model in bf16, SGD on a float32 copy of the parameters that is copied back after each step);
    ``"bf16_params_fp32_master"`` (the same with the parameters cast, the buffers left float32).
    """
    threads = torch.get_num_threads()
    # one thread, as each spawned rank runs: these tiny ops gain nothing from two, and on a
    # busy machine the second thread's waits made the references 10x slower
    torch.set_num_threads(1)
    try:
        return _train_reference(kind)
    finally:
        torch.set_num_threads(threads)


def _train_reference(kind: str) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    data = make_data(NUM_SAMPLES)
    model = reference_model()
    if kind in ("bf16", "bf16_fp32_master"):
        model.to(torch.bfloat16)
    elif kind == "bf16_params_fp32_master":
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    params = list(model.parameters())
    master = [p.detach().float().clone() for p in params] if "master" in kind else None
    optimizer = torch.optim.SGD(master if master is not None else params, lr=LR)
    before = _params(model)
    for step in range(STEPS):
        total, tokens = torch.zeros(()), 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=kind == "autocast"):
            for sample in data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]:
                loss, n = token_loss_sum(model, sample)
                total, tokens = total + loss, tokens + n
        for p in params:
            p.grad = None
        (total / tokens).backward()
        if master is not None:
            for m, p in zip(master, params, strict=True):
                m.grad = p.grad.float()
        optimizer.step()
        if master is not None:
            with torch.no_grad():
                for m, p in zip(master, params, strict=True):
                    p.copy_(m)
    return before, _params(model)


def update(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> np.ndarray:
    """Parameters after minus before, all parameters in one flat vector."""
    assert before.keys() == after.keys()
    return np.concatenate([(after[k] - before[k]).ravel() for k in sorted(after)])


def relative_distance(delta: np.ndarray, delta_fp32: np.ndarray) -> float:
    return float(np.linalg.norm(delta - delta_fp32) / np.linalg.norm(delta_fp32))


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def matrix() -> list[dict[tuple[str, str], dict[str, Any]]]:
    return spawn(_matrix, 4, timeout=900)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_float32_cells_equal_single_process(
    matrix: list[dict[tuple[str, str], dict[str, Any]]], strategy: str
) -> None:
    before, after = reference_training("float32")
    for out in matrix:
        cell = out[(strategy, "32-true")]
        assert cell["dtype"] == "torch.float32"
        assert cell["buffer_dtypes"] == ["torch.float32"]
        assert max_diff(cell["before"], before) == 0.0
        assert max_diff(cell["after"], after) < PARAM_ATOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_16_bit_cells_as_close_to_float32_as_single_process(
    matrix: list[dict[tuple[str, str], dict[str, Any]]], strategy: str, precision: str
) -> None:
    delta_fp32 = update(*reference_training("float32"))
    kind = REFERENCES[(strategy, precision)]
    ref_before, ref_after = reference_training(kind)
    ref_distance = relative_distance(update(ref_before, ref_after), delta_fp32)
    parameter_dtype = "torch.float32" if kind == "autocast" else "torch.bfloat16"
    buffer_dtype = "torch.bfloat16" if kind in ("bf16", "bf16_fp32_master") else "torch.float32"
    for out in matrix:
        cell = out[(strategy, precision)]
        # the cell holds its parameters and buffers in the dtypes its reference does
        assert cell["dtype"] == parameter_dtype
        assert cell["buffer_dtypes"] == [buffer_dtype]
        # the cell starts from the reference's parameters: the same cast of the same init
        assert max_diff(cell["before"], ref_before) == 0.0
        cell_distance = relative_distance(update(cell["before"], cell["after"]), delta_fp32)
        assert cell_distance <= RATIO * ref_distance + FLOOR


# The other update rule a 16-bit cell could be running: float32 master weights against plain
# bf16 SGD (and, for bf16-mixed under DDP, against a bf16 model). Each cell is closer to its own
# reference than to that one (measured, own / other: DDP bf16-mixed 4.0e-3 / 2.0e-2, DDP
# bf16-true 1.2e-2 / 2.9e-2, ZeRO-2 bf16-mixed 1.0e-2 / 2.9e-2, ZeRO-2 bf16-true 1.1e-2 /
# 2.9e-2, relative to the norm of the float32 update): the references model what the cells do,
# beyond landing within the bound above.
ALTERNATIVES = {
    ("ddp", "bf16-mixed"): "bf16_params_fp32_master",
    ("ddp", "bf16-true"): "bf16_fp32_master",
    ("zero2", "bf16-mixed"): "bf16",
    ("zero2", "bf16-true"): "bf16",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("cell_key", list(ALTERNATIVES), ids="-".join)
def test_16_bit_cells_follow_their_reference_update_rule(
    matrix: list[dict[tuple[str, str], dict[str, Any]]], cell_key: tuple[str, str]
) -> None:
    own = update(*reference_training(REFERENCES[cell_key]))
    other = update(*reference_training(ALTERNATIVES[cell_key]))
    for out in matrix:
        cell = update(out[cell_key]["before"], out[cell_key]["after"])
        assert np.linalg.norm(cell - own) < np.linalg.norm(cell - other)


@pytest.mark.multiprocess
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_dp_ranks_plan_different_micro_batch_counts(
    matrix: list[dict[tuple[str, str], dict[str, Any]]], strategy: str, precision: str
) -> None:
    steps = [out[(strategy, precision)]["steps"] for out in matrix]
    assert all(len(s) == STEPS for s in steps)
    planned = [{s[i]["dp_rank"]: s[i]["planned"] for s in steps} for i in range(STEPS)]
    # the plan gives the two DP ranks different counts in some step
    assert any(len(set(counts.values())) > 1 for counts in planned)
    assert any(s[i]["max"] != s[i]["min"] for s in steps for i in range(STEPS))
    runs = [{s[i]["dp_rank"]: s[i]["run"] for s in steps} for i in range(STEPS)]
    if strategy == "ddp":
        # DDP syncs only the last backward: every rank runs its own count
        assert runs == planned
    else:
        # ZeRO-2 reduces gradients in every backward: the data module pads every DP rank with
        # empty micro-batches to the plan's largest count
        assert all(len(set(counts.values())) == 1 for counts in runs)
        assert [max(c.values()) for c in runs] == [max(c.values()) for c in planned]
