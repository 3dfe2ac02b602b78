"""Lightning's weight-averaging callbacks under the Skrull strategies.

Lightning's ``EMAWeightAveraging`` copies the LightningModule in ``setup("fit")``, before the
strategy's setup, updates the copy after each optimizer step, swaps it in around validation
(pairing the copy's tensors with the module's by position), copies it in when training ends and
keeps it in checkpoints. The module stays plain: ``return self.model(**batch).loss``.

One spawn of 4 processes (DP=2 x CP=2, ``SkrullStrategy``) runs four fits of 3 steps with an
EMA of decay :data:`DECAY` and a validation after step 2: ``32-true`` with a checkpoint after
every step, the same fit resumed from the checkpoint of step 1, ``bf16-mixed`` with the
model's parameters in bf16 as a released checkpoint holds them (the strategy casts them to float32
master weights after the callback copied the module, and must cast the copy alike), and that fit
resumed likewise (the checkpoint's float32 weights and average must not pass through bf16). The DP ranks
run different numbers of micro-batches (asserted). Each is compared with the EMA of plain Hugging
Face training on one process over the same global batches (eager attention, one sequence at a
time, the summed token loss over the global batch's supervised tokens, SGD).

The same spawn runs ``StochasticWeightAveraging`` (4 epochs of one global batch, the learning
rate annealed by the callback's ``SWALR``, the weights of 3 epochs averaged), in ``32-true`` and
in ``bf16-mixed`` from bf16 parameters, against the same callback on plain Lightning and Hugging
Face on one process, and each fit resumed from its checkpoint at the end of the first averaged
epoch against the uninterrupted one (the EMA fits likewise, from the checkpoint of step 1). On one process, a resume from a checkpoint written
at an epoch's last step lands as far from the uninterrupted fit under ``SkrullStrategy`` as on
plain Lightning (Lightning skips the callback's ``on_train_epoch_start`` there).

``SkrullFSDPStrategy`` and ``SkrullZero2Strategy`` refuse the callbacks at setup (one process
each); the pairing check is tested on its own.
"""

from __future__ import annotations

import functools
import os
import types
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    LR,
    PlainLM,
    cpu_trainer,
    float64_params,
    global_batches,
    make_data,
    max_diff,
    one_thread,
    reference_loss,
    reference_model,
    sgd_steps,
    token_loss_sum,
)
from lightning.pytorch.callbacks import (
    EMAWeightAveraging,
    ModelCheckpoint,
    StochasticWeightAveraging,
)
from precision_rule import FLOOR, RATIO, relative_distance, update
from torch.utils.data import DataLoader

from lightning_skrull.runtime.launch import spawn

STEPS = 3  # make_data()'s 24 samples in dataset order: one epoch of 3 global batches
DECAY = 0.5  # far from 1, so the average differs from both the first and the last weights
VALIDATE_AFTER = 2  # val_check_interval: one validation, after step 2
RESUME_FROM = 1  # the resumed fit starts from the checkpoint written after step 1
VAL_DATA = make_data(GLOBAL_BATCH, seed=1)
# float32: the packed, sharded run sums the same token terms in another order than the
# reference and DDP averages gradients over 4 ranks; the EMA is a fixed linear combination of
# the weights, so it inherits their float32 rounding (measured max difference 8.9e-8).
PARAM_ATOL = 1e-5
# a loss from float32 sums in another order (measured relative difference 6.5e-8)
LOSS_REL = 1e-5
# a resumed fit plans its global batches with a cost model refitted from its own timings (online
# calibration), so its micro-batches, and the order the token terms are summed in, may differ
# from the uninterrupted fit's (measured max differences 3.7e-9 and 7.5e-9, one or two float32
# ulps of these weights)
RESUME_ATOL = 1e-7
# how far apart the reference's EMA and its last weights are (measured 1.35e-2): the average is
# not the weights, and the tolerances above tell them apart a thousandfold
EMA_IS_NOT_THE_WEIGHTS = 1e-2
# StochasticWeightAveraging: SWA_EPOCHS epochs of one global batch, the second of make_data()
# (the first gives both DP ranks 3 micro-batches, this one 2 and 3); swa_epoch_start=SWA_START:
# the average takes the weights at the start of epochs SWA_START - 1 .. SWA_EPOCHS - 1, i.e.
# after steps 1, 2 and 3 (the last step's weights are never averaged, as on one process); the
# learning rate annealed from LR to SWA_LR over SWA_ANNEAL epochs (cosine) from epoch
# SWA_START - 1 on
SWA_EPOCHS, SWA_START, SWA_LR, SWA_ANNEAL = 4, 2, 0.25, 2
SWA_DATA = make_data()[GLOBAL_BATCH : 2 * GLOBAL_BATCH]
# the callback averages in float32 incrementally (average + (w - average) / (n + 1)); against
# the float64 mean of the same weights that rounds to a few float32 ulps (measured 7.9e-8)
SWA_MEAN_ATOL = 1e-6
# how far the reference's average lies from its last weights and from each averaged one
# (measured 3.2e-2, and 1.4e-2 to 2.0e-2): the tolerances above tell them apart
SWA_IS_NOT_THE_WEIGHTS = 1e-3
# the SWA fit resumed from the checkpoint written at the end of this epoch (0-based): the first
# averaged one, so the checkpoint holds an average of one set of weights (n_averaged 1) and the
# SWALR scheduler stepped once; the resumed fit runs the last two epochs
SWA_RESUME_FROM = SWA_START - 1


# ----------------------------------------------------------------------------- 4 ranks
class AverageRecorder(L.Callback):
    """What the average and the module hold: after each step, around the validation (whose
    hooks run after the EMA callback's swap) and when training ends (after its copy-in)."""

    def __init__(self, ema: EMAWeightAveraging) -> None:
        self.ema = ema
        self.steps: list[dict[str, Any]] = []
        self.validations: list[dict[str, Any]] = []
        self.copy_dtypes: list[str] = []
        self.final: dict[str, np.ndarray] = {}

    def _copy(self) -> Any:
        average = self.ema._average_model
        assert average is not None
        return average.module

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.copy_dtypes = sorted({str(p.dtype) for p in self._copy().parameters()})

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        self.steps.append(
            {
                "average": float64_params(self._copy().model),
                "live": float64_params(module.model),
                "run": len(batch.rank_batch.micro_batches),
                "max": batch.stats.max_micro_batches,
                "min": batch.stats.min_micro_batches,
            }
        )

    def on_validation_epoch_start(self, trainer: Any, module: Any) -> None:
        self.validations.append({"step": trainer.global_step, "seen": float64_params(module.model)})

    def on_validation_epoch_end(self, trainer: Any, module: Any) -> None:
        self.validations[-1]["after"] = float64_params(module.model)

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.validations[-1]["val_loss"] = float(trainer.callback_metrics["val_loss"])

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.final = float64_params(module.model)


def _fit(
    precision: str, *, save_to: str | None = None, ckpt_path: str | None = None
) -> dict[str, Any]:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    ema = EMAWeightAveraging(decay=DECAY)
    recorder = AverageRecorder(ema)
    callbacks: list[Any] = [ema, recorder]  # the recorder's hooks run after the EMA's
    if save_to is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=save_to, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    trainer = cpu_trainer(
        SkrullStrategy(cp_size=2, bucket_size=BUCKET),
        max_steps=STEPS,
        precision=precision,
        callbacks=callbacks,
        enable_checkpointing=save_to is not None,
        limit_val_batches=1,
        val_check_interval=VALIDATE_AFTER,
    )
    module = PlainLM()
    if precision == "bf16-mixed":
        # parameters in bf16, buffers float32: what from_pretrained gives for a bf16 checkpoint
        for p in module.model.parameters():
            p.data = p.data.to(torch.bfloat16)
    data = SkrullDataModule(
        train_data=make_data(),
        val_data=VAL_DATA,
        global_batch_size=GLOBAL_BATCH,
        val_global_batch_size=GLOBAL_BATCH,
        shuffle=False,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return {
        "steps": recorder.steps,
        "validations": recorder.validations,
        "copy_dtypes": recorder.copy_dtypes,
        "final": recorder.final,
    }


def stochastic_weight_averaging() -> StochasticWeightAveraging:
    """The SWA callback of every SWA run, at one process and at 4."""
    return StochasticWeightAveraging(
        swa_lrs=SWA_LR, swa_epoch_start=SWA_START, annealing_epochs=SWA_ANNEAL
    )


class StepRecorder(L.Callback):
    """The learning rate of each step, this rank's micro-batches, the weights when each epoch
    starts, after the last step (``live``) and when training ends (after the SWA callback, whose
    hooks run first, copied the average in)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.epoch_starts: list[dict[str, np.ndarray]] = []
        self.live: dict[str, np.ndarray] = {}
        self.final: dict[str, np.ndarray] = {}

    def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
        self.epoch_starts.append(float64_params(module.model))

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        step: dict[str, Any] = {"lr": trainer.optimizers[0].param_groups[0]["lr"]}
        if hasattr(batch, "rank_batch"):  # a SkrullBatch; the reference's is a list of samples
            step.update(
                run=len(batch.rank_batch.micro_batches),
                max=batch.stats.max_micro_batches,
                min=batch.stats.min_micro_batches,
            )
        self.steps.append(step)
        self.live = float64_params(module.model)

    def on_train_end(self, trainer: Any, module: Any) -> None:
        self.final = float64_params(module.model)


def _swa_fit(
    precision: str, *, save_to: str | None = None, ckpt_path: str | None = None
) -> dict[str, Any]:
    """``StochasticWeightAveraging`` under ``SkrullStrategy``; in ``bf16-mixed`` from parameters
    loaded in bf16, as :func:`_fit`; ``save_to``: a checkpoint at the end of every epoch
    (``epoch={n}.ckpt``); ``ckpt_path``: resumed from that checkpoint."""
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    swa, recorder = stochastic_weight_averaging(), StepRecorder()
    callbacks: list[Any] = [swa, recorder]  # the recorder's hooks run after the SWA callback's
    if save_to is not None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=save_to,
                filename="{epoch}",
                every_n_epochs=1,
                save_top_k=-1,
                save_on_train_epoch_end=True,
            )
        )
    trainer = cpu_trainer(
        SkrullStrategy(cp_size=2, bucket_size=BUCKET),
        max_epochs=SWA_EPOCHS,
        precision=precision,
        callbacks=callbacks,
        enable_checkpointing=save_to is not None,
    )
    module = PlainLM()
    if precision == "bf16-mixed":
        for p in module.model.parameters():
            p.data = p.data.to(torch.bfloat16)
    data = SkrullDataModule(train_data=SWA_DATA, global_batch_size=GLOBAL_BATCH, shuffle=False)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    average = swa._average_model
    assert average is not None
    return {
        "steps": recorder.steps,
        "epoch_starts": recorder.epoch_starts,
        "live": recorder.live,
        "final": recorder.final,
        "copy_dtypes": sorted({str(p.dtype) for p in average.parameters()}),
        "n_averaged": int(swa.n_averaged) if swa.n_averaged is not None else None,
    }


def _cases(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    out = {"32-true": _fit("32-true", save_to=checkpoint_dir)}
    resume = os.path.join(checkpoint_dir, f"step={RESUME_FROM}.ckpt")
    out["resumed"] = _fit("32-true", ckpt_path=resume)
    bf16_dir = os.path.join(checkpoint_dir, "bf16")
    out["bf16-mixed"] = _fit("bf16-mixed", save_to=bf16_dir)
    out["bf16-mixed resumed"] = _fit(
        "bf16-mixed", ckpt_path=os.path.join(bf16_dir, f"step={RESUME_FROM}.ckpt")
    )
    swa_dir = os.path.join(checkpoint_dir, "swa")
    out["swa"] = _swa_fit("32-true", save_to=swa_dir)
    resume = os.path.join(swa_dir, f"epoch={SWA_RESUME_FROM}.ckpt")
    out["swa_resumed"] = _swa_fit("32-true", ckpt_path=resume)
    swa_bf16_dir = os.path.join(checkpoint_dir, "swa_bf16")
    out["swa_bf16"] = _swa_fit("bf16-mixed", save_to=swa_bf16_dir)
    resume = os.path.join(swa_bf16_dir, f"epoch={SWA_RESUME_FROM}.ckpt")
    out["swa_bf16_resumed"] = _swa_fit("bf16-mixed", ckpt_path=resume)
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint_dir = str(tmp_path_factory.mktemp("ema_checkpoints"))
    return spawn(_cases, 4, checkpoint_dir, timeout=600)


# ----------------------------------------------------------------------------- references
@functools.cache
def reference_weights(*, autocast: bool, bf16_start: bool) -> list[dict[str, np.ndarray]]:
    """The parameters before and after each of :data:`STEPS` steps of plain HF training on one
    process (float64 arrays); ``bf16_start``: from the initial parameters rounded to bf16 (a
    bf16 checkpoint's), float32 from there; ``autocast``: the forward under bf16 autocast."""
    data = make_data()
    model = reference_model()
    if bf16_start:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    weights = [float64_params(model)]
    with one_thread():
        batches = global_batches(data, STEPS)
        for _ in sgd_steps(model, optimizer, batches, autocast=autocast):
            weights.append(float64_params(model))
    return weights


def exponential_average(weights: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """``torch.optim.swa_utils.get_ema_avg_fn(DECAY)`` over ``weights``: the first as it is,
    then ``DECAY * average + (1 - DECAY) * weights``."""
    average = dict(weights[0])
    for w in weights[1:]:
        average = {k: DECAY * average[k] + (1 - DECAY) * w[k] for k in average}
    return average


def reference_ema(step: int, **kind: bool) -> dict[str, np.ndarray]:
    """The EMA after ``step`` optimizer steps (updated after each, from the first)."""
    return exponential_average(reference_weights(**kind)[1 : step + 1])


FLOAT32 = {"autocast": False, "bf16_start": False}


class ReferenceLM(L.LightningModule):
    """Plain Lightning and Hugging Face on one process: a step is a global batch (a list of
    samples), one sequence at a time, the summed token loss over its supervised tokens; from
    the initial parameters rounded to bf16 with ``bf16_start``, float32 from there."""

    def __init__(self, bf16_start: bool) -> None:
        super().__init__()
        self.model = reference_model()
        if bf16_start:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(torch.bfloat16))

    def training_step(self, batch: list[dict[str, list[int]]], batch_idx: int) -> torch.Tensor:
        total, tokens = torch.zeros(()), 0
        for sample in batch:
            loss, n = token_loss_sum(self.model, sample)
            total, tokens = total + loss, tokens + n
        return total / tokens

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


@functools.cache
def swa_reference(*, autocast: bool, bf16_start: bool) -> dict[str, Any]:
    """What Lightning's ``StochasticWeightAveraging`` (:func:`stochastic_weight_averaging`) does
    to plain training on one process (:class:`ReferenceLM`, the default single-device strategy)
    over the same global batches, in ``"bf16-mixed"`` (autocast) with ``autocast``: the
    parameters it starts from (``start``), the learning rate of each step, the weights when
    each epoch starts, after the last step (``live``) and at the end (``final``)."""
    module, recorder = ReferenceLM(bf16_start), StepRecorder()
    start = float64_params(module.model)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=SWA_EPOCHS,
        precision="bf16-mixed" if autocast else "32-true",
        callbacks=[stochastic_weight_averaging(), recorder],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(SWA_DATA, batch_size=GLOBAL_BATCH, collate_fn=list)
    with one_thread():
        trainer.fit(module, loader)
    return {
        "start": start,
        "lrs": [s["lr"] for s in recorder.steps],
        "epoch_starts": recorder.epoch_starts,
        "live": recorder.live,
        "final": recorder.final,
    }


# ----------------------------------------------------------------------------- tests
@pytest.mark.multiprocess
def test_micro_batch_counts_differ_between_dp_ranks(ranks: list[dict[str, Any]]) -> None:
    for run in (
        "32-true",
        "resumed",
        "bf16-mixed",
        "bf16-mixed resumed",
        "swa",
        "swa_resumed",
        "swa_bf16",
        "swa_bf16_resumed",
    ):
        steps = [out[run]["steps"] for out in ranks]
        assert any(s["max"] != s["min"] for s in steps[0])
        # DP rank 0 (processes 0, 1) and DP rank 1 (processes 2, 3) ran different counts
        runs = [[s["run"] for s in rank_steps] for rank_steps in steps]
        assert runs[0] == runs[1] and runs[2] == runs[3] and runs[0] != runs[2]


@pytest.mark.multiprocess
def test_ema_equals_single_process_ema_float32(ranks: list[dict[str, Any]]) -> None:
    final_weights = reference_weights(**FLOAT32)[-1]
    assert max_diff(reference_ema(STEPS, **FLOAT32), final_weights) > EMA_IS_NOT_THE_WEIGHTS
    for out in ranks:
        run = out["32-true"]
        assert run["copy_dtypes"] == ["torch.float32"]
        for step, recorded in enumerate(run["steps"], start=1):
            assert max_diff(recorded["live"], reference_weights(**FLOAT32)[step]) < PARAM_ATOL
            assert max_diff(recorded["average"], reference_ema(step, **FLOAT32)) < PARAM_ATOL
        # the module holds the average after training, exactly
        assert max_diff(run["final"], run["steps"][-1]["average"]) == 0.0


@pytest.mark.multiprocess
def test_validation_sees_the_average_and_training_gets_its_weights_back(
    ranks: list[dict[str, Any]],
) -> None:
    expected = reference_ema(VALIDATE_AFTER, **FLOAT32)
    val_loss = reference_loss({k: v.astype(np.float32) for k, v in expected.items()}, VAL_DATA)
    for out in ranks:
        for run in ("32-true", "bf16-mixed"):
            (validation,) = out[run]["validations"]
            assert validation["step"] == VALIDATE_AFTER
            step = out[run]["steps"][VALIDATE_AFTER - 1]
            # the swap puts the average in, exactly, and gives the training weights back,
            # exactly (a bf16 copy of float32 weights would round them here)
            assert max_diff(validation["seen"], step["average"]) == 0.0
            assert max_diff(validation["after"], step["live"]) == 0.0
        (validation,) = out["32-true"]["validations"]
        assert max_diff(validation["seen"], expected) < PARAM_ATOL
        # the synced validation loss is the plain model's under the averaged weights
        assert validation["val_loss"] == pytest.approx(val_loss, rel=LOSS_REL)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("whole_key", "resumed_key"), [("32-true", "resumed"), ("bf16-mixed", "bf16-mixed resumed")]
)
def test_resumed_fit_continues_the_same_average(
    ranks: list[dict[str, Any]], whole_key: str, resumed_key: str
) -> None:
    """The checkpoint of step 1 holds the average (in ``state_dict``) and the training weights
    (``current_model_state``); the fit resumed from it runs steps 2 and 3 as the uninterrupted
    fit did: the same average, to float32 rounding (:data:`RESUME_ATOL`). In ``bf16-mixed``
    from parameters loaded in bf16 too: the checkpoint's float32 master weights and average
    are loaded into float32 (copied into the bf16 parameters first, as Lightning restores a
    DDP checkpoint before the strategy's cast, they were off by 1.6e-3; measured now 3.7e-9
    for the weights and 7.5e-9 for the average in both precisions)."""
    for out in ranks:
        whole, resumed = out[whole_key], out[resumed_key]
        assert resumed["copy_dtypes"] == ["torch.float32"]
        assert len(resumed["steps"]) == STEPS - RESUME_FROM
        for a, b in zip(whole["steps"][RESUME_FROM:], resumed["steps"], strict=True):
            assert max_diff(a["live"], b["live"]) < RESUME_ATOL
            assert max_diff(a["average"], b["average"]) < RESUME_ATOL
        assert max_diff(whole["final"], resumed["final"]) < RESUME_ATOL
        if whole_key == "32-true":
            assert max_diff(resumed["final"], reference_ema(STEPS, **FLOAT32)) < PARAM_ATOL


@pytest.mark.multiprocess
def test_ema_bf16_mixed_from_bf16_weights(ranks: list[dict[str, Any]]) -> None:
    """A bf16-mixed fit of parameters loaded in bf16: the strategy casts them to float32 after
    the callback copied the module, and casts the copy alike, so the EMA accumulates in float32.
    Its update from the start is held to the 16-bit rule of tests/strategies/test_precision_matrix.py
    against the EMA of float32 training from the same bf16 start: distance at most
    ``RATIO`` x the single-process bf16-autocast EMA's distance + ``FLOOR``. Measured: d(cell)
    3.2e-3, d(ref) 4.3e-3, bound 9.6e-3; an update 5% too large would be at 5.0e-2."""
    float32 = {"autocast": False, "bf16_start": True}
    autocast = {"autocast": True, "bf16_start": True}
    start = reference_weights(**float32)[0]
    delta_fp32 = update(start, reference_ema(STEPS, **float32))
    own = relative_distance(update(start, reference_ema(STEPS, **autocast)), delta_fp32)
    bound = RATIO * own + FLOOR
    for out in ranks:
        run = out["bf16-mixed"]
        assert run["copy_dtypes"] == ["torch.float32"]  # cast with the master weights
        distance = relative_distance(update(start, run["final"]), delta_fp32)
        assert distance <= bound, (distance, own, bound)


@pytest.mark.multiprocess
def test_swa_equals_single_process_swa_float32(ranks: list[dict[str, Any]]) -> None:
    """``StochasticWeightAveraging`` at DP=2 x CP=2 against the same callback on plain
    Lightning and HF on one process: the same annealed learning rates, the weights at every
    epoch's start (to :data:`PARAM_ATOL`), and the average copied in at the end; the average is
    the mean of the weights after steps 1 to 3 (to :data:`SWA_MEAN_ATOL`)."""
    ref = swa_reference(**FLOAT32)
    # the annealing moved the learning rate, and the average is neither the last weights nor
    # any of the averaged ones
    assert len(set(ref["lrs"])) > 1 and ref["lrs"][0] == LR
    assert max_diff(ref["final"], ref["live"]) > SWA_IS_NOT_THE_WEIGHTS
    for averaged in ref["epoch_starts"][SWA_START - 1 :]:
        assert max_diff(ref["final"], averaged) > SWA_IS_NOT_THE_WEIGHTS
    for out in ranks:
        run = out["swa"]
        assert run["copy_dtypes"] == ["torch.float32"]
        assert run["n_averaged"] == SWA_EPOCHS - SWA_START + 1
        assert [s["lr"] for s in run["steps"]] == ref["lrs"]
        assert len(run["epoch_starts"]) == len(ref["epoch_starts"]) == SWA_EPOCHS
        for a, b in zip(run["epoch_starts"], ref["epoch_starts"], strict=True):
            assert max_diff(a, b) < PARAM_ATOL
        assert max_diff(run["live"], ref["live"]) < PARAM_ATOL
        assert max_diff(run["final"], ref["final"]) < PARAM_ATOL
        # a hand-written average of this run's own weights when epochs 1 to 3 started
        averaged = run["epoch_starts"][SWA_START - 1 :]
        mean = {k: sum(w[k] for w in averaged) / len(averaged) for k in run["final"]}
        assert max_diff(run["final"], mean) < SWA_MEAN_ATOL


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("whole_key", "resumed_key"), [("swa", "swa_resumed"), ("swa_bf16", "swa_bf16_resumed")]
)
def test_swa_resumed_from_an_epoch_end_checkpoint_equals_the_uninterrupted_run(
    ranks: list[dict[str, Any]], whole_key: str, resumed_key: str
) -> None:
    """``StochasticWeightAveraging`` resumed from the checkpoint written at the end of epoch
    :data:`SWA_RESUME_FROM` (``ModelCheckpoint(every_n_epochs=1, save_on_train_epoch_end=True)``;
    the callback's state holds the average, ``n_averaged`` and the SWALR scheduler's state) runs
    the last two epochs as the uninterrupted fit did: the same learning rates, the same weights
    at each epoch's start, the same last weights and the same average copied in, to
    :data:`RESUME_ATOL` (a resumed fit's cost model is refitted from its own timings, so its
    micro-batches may sum in another order; measured 3.7e-9 for the average, 7.5e-9 for the last
    weights, in ``32-true`` and in ``bf16-mixed`` from bf16 parameters alike; in ``bf16-mixed``
    the weights were off by 3.8e-3 when the checkpoint was loaded into the bf16 parameters
    before the strategy's float32 cast). A resume that restarted the average (``n_averaged`` 0) would end at the mean of the
    last two epochs' weights, more than :data:`SWA_IS_NOT_THE_WEIGHTS` away. A checkpoint written inside an epoch does not resume
    SWA exactly, under Lightning's own strategies too (docs/lightning.md)."""
    for out in ranks:
        whole, resumed = out[whole_key], out[resumed_key]
        assert whole["n_averaged"] == resumed["n_averaged"] == SWA_EPOCHS - SWA_START + 1
        later = SWA_RESUME_FROM + 1  # the resumed fit's first epoch
        assert [s["lr"] for s in resumed["steps"]] == [s["lr"] for s in whole["steps"]][later:]
        assert len(resumed["epoch_starts"]) == SWA_EPOCHS - later
        for a, b in zip(whole["epoch_starts"][later:], resumed["epoch_starts"], strict=True):
            assert max_diff(a, b) < RESUME_ATOL
        assert max_diff(whole["live"], resumed["live"]) < RESUME_ATOL
        assert max_diff(whole["final"], resumed["final"]) < RESUME_ATOL
        restarted = whole["epoch_starts"][later:]
        mean = {k: sum(w[k] for w in restarted) / len(restarted) for k in whole["final"]}
        assert max_diff(whole["final"], mean) > SWA_IS_NOT_THE_WEIGHTS


@pytest.mark.multiprocess
def test_swa_bf16_mixed_from_bf16_weights(ranks: list[dict[str, Any]]) -> None:
    """``StochasticWeightAveraging`` in ``bf16-mixed`` from parameters loaded in bf16 (its copy
    cast to float32 with the master weights): the final average's update from the start is held
    to the 16-bit rule against the same callback on plain Lightning in float32 from the same
    bf16 start, with plain Lightning's own ``bf16-mixed`` run as d(ref). Measured: d(cell)
    2.1e-3, d(ref) 2.2e-3, bound 5.4e-3; an update 5% too large would be at
    5.0e-2, and the last weights in place of the average (the callback not copying it in)
    at 7.3e-1."""
    float32 = swa_reference(autocast=False, bf16_start=True)
    autocast = swa_reference(autocast=True, bf16_start=True)
    start = float32["start"]
    delta_fp32 = update(start, float32["final"])
    own = relative_distance(update(start, autocast["final"]), delta_fp32)
    bound = RATIO * own + FLOOR
    for out in ranks:
        run = out["swa_bf16"]
        assert run["copy_dtypes"] == ["torch.float32"]  # cast with the master weights
        assert [s["lr"] for s in run["steps"]] == float32["lrs"]
        cell = update(start, run["final"])
        distance = relative_distance(cell, delta_fp32)
        assert distance <= bound, (distance, own, bound)
        # the bound catches a gradient 5% off, and the average left out
        assert relative_distance(1.05 * cell, delta_fp32) > bound
        assert relative_distance(update(start, run["live"]), delta_fp32) > bound


# ----------------------------------------------------------------------------- one process
def _refused_fit(strategy: Any, callback: L.Callback) -> None:
    from lightning_skrull import SkrullDataModule

    trainer = cpu_trainer(strategy, max_steps=1, callbacks=[callback])
    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH)
    trainer.fit(PlainLM(), data)


@pytest.mark.parametrize(
    "callback",
    [EMAWeightAveraging(decay=DECAY), StochasticWeightAveraging(swa_lrs=LR)],
    ids=["ema", "swa"],
)
def test_fsdp_refuses_weight_averaging_at_setup(world_of_one: None, callback: Any) -> None:
    from lightning_skrull import SkrullFSDPStrategy

    name = type(callback).__name__
    with pytest.raises(ValueError, match=rf"{name} cannot .*SkrullFSDPStrategy.*DTensor shards"):
        _refused_fit(SkrullFSDPStrategy(bucket_size=80), callback)


def test_zero2_refuses_weight_averaging_at_setup(world_of_one: None) -> None:
    from lightning_skrull import SkrullZero2Strategy

    with pytest.raises(
        ValueError,
        match=r"EMAWeightAveraging cannot .*SkrullZero2Strategy.*save_pretrained.*SkrullStrategy",
    ):
        _refused_fit(SkrullZero2Strategy(bucket_size=80), EMAWeightAveraging(decay=DECAY))


class BatchNormLM(PlainLM):
    """:class:`PlainLM` with a BatchNorm layer (unused by the step: its presence is the case)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(4)


def test_swa_with_batch_norm_is_refused_at_setup(world_of_one: None) -> None:
    """``StochasticWeightAveraging`` on a module with BatchNorm layers adds an epoch after
    training run as one step (``accumulate_grad_batches`` raised to the epoch's batches), which
    ``SkrullStrategy`` refuses: left alone, the fit trained every epoch and failed at that
    epoch's first step. Refused before the first step instead; without the layer it trains."""
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    def trainer() -> L.Trainer:
        return cpu_trainer(
            SkrullStrategy(bucket_size=80),
            max_epochs=2,
            callbacks=[StochasticWeightAveraging(swa_lrs=LR, swa_epoch_start=1)],
        )

    def data() -> SkrullDataModule:
        return SkrullDataModule(train_data=SWA_DATA, global_batch_size=GLOBAL_BATCH)

    refused = trainer()
    with pytest.raises(
        ValueError,
        match=r"StochasticWeightAveraging .*BatchNorm layer 'norm' \(BatchNorm1d\).*under "
        r"SkrullStrategy one global batch is one step.*update_bn",
    ):
        refused.fit(BatchNormLM(), data())
    assert refused.global_step == 0
    trained = trainer()
    trained.fit(PlainLM(), data())
    assert trained.global_step == 2


def _swa_one_process(
    skrull: bool, checkpoint_dir: str, ckpt_path: str | None = None
) -> dict[str, np.ndarray]:
    """The final weights of :func:`stochastic_weight_averaging` over :data:`SWA_EPOCHS` epochs of
    :data:`SWA_DATA` on one process, a checkpoint after every step (``step={n}.ckpt``) or resumed
    from ``ckpt_path``: under ``SkrullStrategy`` (``PlainLM``, the data module) or on plain
    Lightning (``ReferenceLM``, a plain DataLoader, the default single-device strategy)."""
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    swa, recorder = stochastic_weight_averaging(), StepRecorder()
    callbacks: list[Any] = [swa, recorder]
    if ckpt_path is None:
        callbacks.append(
            ModelCheckpoint(
                dirpath=checkpoint_dir, filename="{step}", every_n_train_steps=1, save_top_k=-1
            )
        )
    kwargs: dict[str, Any] = {
        "max_epochs": SWA_EPOCHS,
        "callbacks": callbacks,
        "enable_checkpointing": ckpt_path is None,
    }
    with one_thread():
        if skrull:
            trainer = cpu_trainer(SkrullStrategy(bucket_size=80, calibration="off"), **kwargs)
            data = SkrullDataModule(
                train_data=SWA_DATA, global_batch_size=GLOBAL_BATCH, shuffle=False
            )
            trainer.fit(PlainLM(), data, ckpt_path=ckpt_path)
        else:
            trainer = cpu_trainer("auto", **kwargs)
            loader = DataLoader(SWA_DATA, batch_size=GLOBAL_BATCH, collate_fn=list)
            trainer.fit(ReferenceLM(bf16_start=False), loader, ckpt_path=ckpt_path)
    return recorder.final


def test_swa_resumed_from_a_step_checkpoint_as_on_plain_lightning(
    world_of_one: None, tmp_path: Any
) -> None:
    """``StochasticWeightAveraging`` resumed from a checkpoint written at an epoch's last step
    (``every_n_train_steps=1``; here the end of epoch 1, the first averaged one) does under
    ``SkrullStrategy`` what it does on plain Lightning: the two resumed fits agree to
    :data:`PARAM_ATOL` (measured 1.0e-8), as do the two uninterrupted ones (1.1e-8). Lightning
    2.6.6 skips the callback's ``on_train_epoch_start`` of the next epoch, so both resumed fits
    miss that epoch's average update and lie 7.2e-3 from the uninterrupted one
    (docs/lightning.md); that is Lightning's behaviour, so it is measured, not asserted, and a
    Lightning release that resumes it exactly keeps this test green."""
    runs = {}
    for skrull in (True, False):
        directory = str(tmp_path / ("skrull" if skrull else "plain"))
        whole = _swa_one_process(skrull, directory)
        resumed = _swa_one_process(skrull, directory, os.path.join(directory, "step=2.ckpt"))
        runs[skrull] = whole, resumed
    assert max_diff(runs[True][0], runs[False][0]) < PARAM_ATOL
    assert max_diff(runs[True][1], runs[False][1]) < PARAM_ATOL


def test_pairing_check_refuses_a_copy_that_no_longer_matches() -> None:
    """The callbacks zip the copy's tensors with the module's by position: a tensor the module
    gained after the copy, or a copy narrower than the module's dtype, is refused."""
    from lightning_skrull.strategies.weight_averaging import (
        check_averaged_pairs,
        match_averaged_dtypes,
    )

    module = PlainLM()
    ema = EMAWeightAveraging(decay=DECAY)
    trainer = types.SimpleNamespace(callbacks=[ema])
    ema.setup(trainer, module, "fit")  # type: ignore[arg-type]
    check_averaged_pairs(trainer, module, "S")  # type: ignore[arg-type]
    module.model.model.embed_tokens.register_buffer("scale", torch.ones(1))
    with pytest.raises(
        RuntimeError, match=r"EMAWeightAveraging pairs .*after S's setup.*embed_tokens.scale"
    ):
        check_averaged_pairs(trainer, module, "S")  # type: ignore[arg-type]

    module = PlainLM()
    module.model.to(torch.bfloat16)
    ema.setup(trainer, module, "fit")  # type: ignore[arg-type]
    module.model.lm_head.float()  # as the float32 master cast does, after the copy was made
    with pytest.raises(RuntimeError, match=r"'model.lm_head.weight' is torch.bfloat16"):
        check_averaged_pairs(trainer, module, "S")  # type: ignore[arg-type]
    assert match_averaged_dtypes(trainer, module) == 1  # type: ignore[arg-type]
    check_averaged_pairs(trainer, module, "S")  # type: ignore[arg-type]
