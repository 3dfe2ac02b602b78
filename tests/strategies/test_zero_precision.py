"""SkrullZero2Strategy keeps the earlier micro-batches' gradients under every DeepSpeed precision
set-up it accepts: ZeRO stage 1 or 2, float32 or bf16 (``bf16-mixed`` and ``bf16-true`` both turn
on DeepSpeed's ``bf16``), and each gradient accumulation dtype (``data_types.grad_accum_dtype``
unset, ``"fp32"`` or ``"bf16"``).

Lightning calls ``optimizer.zero_grad()`` after ``training_step``, where the strategy has already
run the earlier micro-batches' backward, and on ZeRO-1 some DeepSpeed optimizers keep those
gradients in buffers their ``zero_grad`` clears (the BF16 optimizer, with bf16 and fp32
accumulation; ``param.grad_accum``, with a float32 model and bf16 accumulation). So the same
global batch runs once as one micro-batch per rank and once as several, and both updates must
equal the update of plain single-process training.

One spawn of 2 processes (DP=2 x CP=1) runs every case: 2 optimizer steps of SGD, so that a
gradient the engine failed to clear after the first step would also show. The update read is
DeepSpeed's float32 master copy of the parameters.

Both references are independent of the package: a plain Hugging Face model with eager attention
on one process, one sequence at a time, summed token cross-entropy over the global batch's
supervised tokens, one backward per global batch; in float32, and in bf16 with float32 master
weights (what DeepSpeed's bf16 does).

On one process: a later fit of a model a ``bf16-mixed`` fit trained, which would start from the
bf16 copies of the masters DeepSpeed kept in its optimizer, is refused unless it resumes a
checkpoint.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from helpers import (
    GLOBAL_BATCH,
    LR,
    UNFREEZE_AT,
    BatchRecorder,
    PlainLM,
    UnfreezingLM,
    cpu_trainer,
    make_data,
    reference_model,
    token_loss_sum,
)

from lightning_skrull.runtime.launch import spawn

STEPS = 2
ONE_MICRO_BATCH = 400  # tokens per rank: a DP rank's share of each global batch fits at once
SEVERAL_MICRO_BATCHES = 70  # just above the longest sample: 3 to 4 micro-batches per rank, the
# two DP ranks' plans 4 and 3 in the first step (asserted)

CASES: list[tuple[int, str, str | None]] = [
    *(
        (stage, precision, grad_accum_dtype)
        for stage in (1, 2)
        for precision, other_dtype in (("32-true", "bf16"), ("bf16-mixed", "fp32"))
        for grad_accum_dtype in (None, other_dtype)
    ),
    (1, "bf16-true", "fp32"),
]
"""(ZeRO stage, Trainer precision, ``data_types.grad_accum_dtype``). ``None`` is DeepSpeed's
default, the model's dtype (DeepSpeed 0.19.8 ``get_data_types``), so giving that dtype
explicitly is the same set-up; the other dtype is the one case left per stage and precision."""

# Float32 model and float32 accumulation: the sharded, packed computation sums the same token
# terms in another order than the reference, and DeepSpeed averages gradients over 2 ranks. The
# relative distance of the updates is float32 rounding (measured up to 3.1e-7).
FLOAT32_REL_TOL = 1e-5
# bf16 anywhere (model or accumulation): a run's update may be at most twice as far from the
# float32 reference as the single-process bf16 run's is (measured 6.6e-3, so 1.3e-2), and never
# less than a floor of 1e-2, about 1.5 times the largest distance of a correct bf16 run: a bf16
# reference that happened to round closer to float32 must not fail runs that are right. Measured
# runs: 2.5e-3 .. 3.3e-3 (float32 model, bf16 accumulation) and 6.0e-3 .. 6.4e-3 (bf16 model),
# up to 5.0e-3 between the one- and several-micro-batch runs of a case; a run that loses its
# earlier micro-batches' gradients is 0.84 away.
BF16_RATIO = 2.0
BF16_FLOOR = 1e-2


def _case_id(case: tuple[int, str, str | None]) -> str:
    stage, precision, grad_accum_dtype = case
    return f"stage{stage}-{precision}-accum_{grad_accum_dtype or 'default'}"


class MasterUpdate(L.Callback):
    """The change of DeepSpeed's float32 master parameters (gathered over the ranks) over the
    run; under bf16 they start from the bf16-rounded initial weights."""

    def __init__(self) -> None:
        self.start: dict[str, np.ndarray] = {}
        self.update: dict[str, np.ndarray] = {}
        self.optimizer = ""
        self.zero_grad_released = False

    @staticmethod
    def _master(module: L.LightningModule) -> dict[str, np.ndarray]:
        from deepspeed.utils import safe_get_full_fp32_param

        return {
            name: safe_get_full_fp32_param(param).detach().double().numpy()
            for name, param in module.model.named_parameters()
        }

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.start = self._master(module)

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        optimizer = trainer.strategy.optimizers[0]
        self.optimizer = type(optimizer).__name__
        wrappers = trainer.strategy._lightning_optimizers
        self.zero_grad_released = all("zero_grad" not in vars(o) for o in [optimizer, *wrappers])
        end = self._master(module)
        self.update = {name: end[name] - self.start[name] for name in end}


def _fit_case(
    stage: int, precision: str, grad_accum_dtype: str | None, bucket_size: int
) -> dict[str, Any]:
    from lightning_skrull import SkrullDataModule, SkrullZero2Strategy

    config: dict[str, Any] = {
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,  # torch SGD, as in the reference
    }
    if grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": grad_accum_dtype}
    recorder, master = BatchRecorder(), MasterUpdate()
    trainer = cpu_trainer(
        SkrullZero2Strategy(bucket_size=bucket_size, config=config),
        max_steps=STEPS,
        precision=precision,
        callbacks=[recorder, master],
    )
    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH, shuffle=False)
    trainer.fit(PlainLM(), data)
    return {
        "update": master.update,
        "optimizer": master.optimizer,
        "released": master.zero_grad_released,
        "micro_batches": [step["run"] for step in recorder.steps],
        "planned": [step["planned"] for step in recorder.steps],
    }


def _all_cases(rank: int, world_size: int) -> dict[tuple[Any, ...], dict[str, Any]]:
    out = {}
    for case in CASES:
        for bucket_size in (ONE_MICRO_BATCH, SEVERAL_MICRO_BATCHES):
            out[(*case, bucket_size)] = _fit_case(*case, bucket_size)
    return out


@pytest.fixture(scope="module")
def zero_runs() -> list[dict[tuple[Any, ...], dict[str, Any]]]:
    return spawn(_all_cases, 2, timeout=600)


# ----------------------------------------------------------------------------- references
def _flat(params: dict[str, Any]) -> np.ndarray:
    return np.concatenate([np.asarray(params[name], dtype=np.float64).ravel() for name in params])


@functools.cache
def reference_updates() -> tuple[np.ndarray, np.ndarray]:
    """(float32 update, bf16 update) of single-process training over ``STEPS`` global batches."""
    data = make_data()
    updates = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread
    try:
        for dtype in (torch.float32, torch.bfloat16):
            updates.append(_reference_update(data, dtype))
    finally:
        torch.set_num_threads(threads)
    return updates[0], updates[1]


def _reference_update(data: list[dict[str, list[int]]], dtype: torch.dtype) -> np.ndarray:
    """Plain HF training in ``dtype`` with float32 master weights (SGD on the masters, the
    model's weights copied from them after each step)."""
    model = reference_model().to(dtype)
    master = {k: v.detach().float() for k, v in model.named_parameters()}
    initial = _flat(master)
    for step in range(STEPS):
        total, tokens = torch.zeros(()), 0
        for sample in data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]:
            loss, n = token_loss_sum(model, sample)
            total, tokens = total + loss, tokens + n
        model.zero_grad()
        (total / tokens).backward()
        with torch.no_grad():
            for name, param in model.named_parameters():
                master[name] -= LR * param.grad.float()
                param.copy_(master[name])
    return _flat(master) - initial


def _relative_distance(update: np.ndarray, reference: np.ndarray) -> float:
    return float(np.linalg.norm(update - reference) / np.linalg.norm(reference))


# ----------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_update_equals_single_process_with_one_or_several_micro_batches(
    zero_runs: list[dict[tuple[Any, ...], dict[str, Any]]], case: tuple[int, str, str | None]
) -> None:
    stage, precision, grad_accum_dtype = case
    update32, update_bf16 = reference_updates()
    uses_bf16 = precision.startswith("bf16") or grad_accum_dtype == "bf16"
    bf16_tol = max(BF16_RATIO * _relative_distance(update_bf16, update32), BF16_FLOOR)
    for out in zero_runs:
        one = out[(*case, ONE_MICRO_BATCH)]
        several = out[(*case, SEVERAL_MICRO_BATCHES)]
        # the same global batches as 1 and as 3..4 micro-batches per rank
        assert one["micro_batches"] == [1] * STEPS
        assert min(several["micro_batches"]) >= 3 and max(several["micro_batches"]) >= 4
        # ZeRO-1 with bf16 and fp32 accumulation is the one case on DeepSpeed's BF16 optimizer
        bf16_optimizer = stage == 1 and precision.startswith("bf16") and grad_accum_dtype == "fp32"
        expected = "BF16_Optimizer" if bf16_optimizer else "DeepSpeedZeroOptimizer"
        assert one["optimizer"] == several["optimizer"] == expected
        assert one["released"] and several["released"]
        update_one, update_several = _flat(one["update"]), _flat(several["update"])
        dist_one = _relative_distance(update_one, update32)
        dist_several = _relative_distance(update_several, update32)
        tol = bf16_tol if uses_bf16 else FLOAT32_REL_TOL
        assert dist_one <= tol, (dist_one, tol)
        assert dist_several <= tol, (dist_several, tol)
        assert _relative_distance(update_several, update_one) <= tol
    # the DP ranks' plans differ in micro-batch count (4 and 3 in the first step), and ZeRO pads
    # the shorter one with empty micro-batches, so both run the same count
    several = [out[(*case, SEVERAL_MICRO_BATCHES)] for out in zero_runs]
    assert several[0]["planned"] != several[1]["planned"]
    assert several[0]["micro_batches"] == several[1]["micro_batches"]


def test_held_zero_grad_keeps_gradients_until_released() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    from lightning_skrull.strategies.deepspeed import _HeldZeroGrad

    param = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=1.0)
    wrapper = LightningOptimizer(optimizer)
    held = _HeldZeroGrad()
    param.grad = torch.full((2,), 3.0)
    held.hold([optimizer, wrapper])
    held.hold([optimizer])  # holding twice keeps one record, so one release restores
    assert held.active
    optimizer.zero_grad()
    wrapper.zero_grad()  # the wrapper's class derives from SGD: it is held on its own
    assert param.grad is not None and torch.equal(param.grad, torch.full((2,), 3.0))
    held.release()
    assert not held.active
    assert "zero_grad" not in vars(optimizer) and "zero_grad" not in vars(wrapper)
    wrapper.zero_grad()
    assert param.grad is None


def test_a_later_fit_from_the_16_bit_copies_of_the_masters_is_refused(
    world_of_one: None, tmp_path: Any
) -> None:
    """After a ``bf16-mixed`` fit under ``SkrullZero2Strategy`` the float32 master weights stay
    in DeepSpeed's optimizer and the model holds their bf16 copies: a second ``trainer.fit`` on
    the same Trainer (one step more, as in a notebook) or a fit under another strategy would
    start from weights rounded to bf16 (measured at DP=2 x CP=2: 7.8e-3 from the uninterrupted
    run after 4 steps, 0.0 in ``32-true``). Both are refused before any step; resuming the
    first fit's checkpoint, which holds the masters, trains on. In ``32-true`` the model's
    parameters are the masters, and a second fit trains on."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_skrull import SkrullDataModule, SkrullStrategy, SkrullZero2Strategy

    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH)
    module = PlainLM()
    save = ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=1)
    trainer = cpu_trainer(
        SkrullZero2Strategy(bucket_size=ONE_MICRO_BATCH), max_steps=1, precision="bf16-mixed",
        callbacks=[save], enable_checkpointing=True,
    )  # fmt: skip
    trainer.fit(module, data)
    trainer.fit_loop.epoch_loop.max_steps = 2
    refusal = (
        r"SkrullZero2Strategy in 'bf16-mixed' in this process\. DeepSpeed kept its float32 "
        r"master weights .* rounded to 16 bits .* ckpt_path=.*strategy\.save_pretrained"
    )
    with pytest.raises(ValueError, match=rf"SkrullZero2Strategy: .*{refusal}"):
        trainer.fit(module, data)
    with pytest.raises(ValueError, match=rf"SkrullStrategy: .*{refusal}"):
        cpu_trainer(SkrullStrategy(bucket_size=ONE_MICRO_BATCH), max_steps=1).fit(module, data)
    assert trainer.global_step == 1  # no step was trained
    trainer.fit(module, data, ckpt_path=str(tmp_path / "step=1.ckpt"))
    assert trainer.global_step == 2
    float32 = PlainLM()
    trainer = cpu_trainer(SkrullZero2Strategy(bucket_size=ONE_MICRO_BATCH), max_steps=1)
    trainer.fit(float32, data)
    trainer.fit_loop.epoch_loop.max_steps = 2
    trainer.fit(float32, data)
    assert trainer.global_step == 2


def test_parameters_frozen_or_unfrozen_mid_fit_are_refused(world_of_one: None) -> None:
    """DeepSpeed builds its optimizer's partitions from the parameters trainable when the fit
    starts: embeddings unfrozen in a hook later were never trained (0.021 from one process after
    4 steps at DP=2 x CP=2, exactly their starting values), and a head frozen later would still
    be stepped. Both are refused before the step that would run with them, naming them.
    (Lightning itself refuses its ``BaseFinetuning`` callbacks under DeepSpeed.) Both fits run
    in one test: DeepSpeed keeps its process groups across a new default group."""
    from lightning_skrull import SkrullDataModule, SkrullZero2Strategy

    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH)
    for freeze_head in (False, True):
        trainer = cpu_trainer(SkrullZero2Strategy(bucket_size=ONE_MICRO_BATCH), max_steps=3)
        change = r"unfrozen 1 \(model\.model\.embed_tokens\.weight\)"
        if freeze_head:
            change += r"; frozen 1 \(model\.lm_head\.weight\)"
        refusal = (
            rf"SkrullZero2Strategy: the trainable parameters changed during the fit, before "
            rf"global step {UNFREEZE_AT} \({change}\)\..*never be trained.*still be stepped.*"
            r"save_pretrained.*SkrullStrategy or SkrullFSDPStrategy"
        )
        with pytest.raises(ValueError, match=refusal):
            trainer.fit(UnfreezingLM(freeze_head=freeze_head), data)
        assert trainer.global_step == UNFREEZE_AT
