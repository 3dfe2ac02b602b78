"""Lightning's habits under Skrull: ``self.log(..., sync_dist=True)``, hooks, clipping (by norm
and by value), callbacks' outputs, torchmetrics, ``EarlyStopping`` / ``ModelCheckpoint`` on
``val_loss``, ``limit_train_batches`` and mid-epoch validation (``val_check_interval``),
Lightning's ``ThroughputMonitor`` with model FLOPs, ``self.log_dict``, the learning-rate finder,
``max_time`` and ``OnExceptionCheckpoint`` (and resuming from what they leave),
``detect_anomaly``, ``deterministic``, the simple profiler, a ``CSVLogger``, ``overfit_batches``,
``fast_dev_run``, ``trainer.should_stop`` set on one rank, ``on_train_batch_start`` returning
``-1`` on one rank, a second ``trainer.fit`` on the same Trainer and ``BaseFinetuning``, with DP
ranks that run different numbers of micro-batches.

One spawn of 4 processes (DP=2 x CP=2) runs every multi-process case, in ``32-true`` and
``bf16-mixed`` (the callbacks, value clipping and short epochs in ``32-true``); the bytes the CP
groups exchange are counted in both. The data is built so that the planner gives the two DP
ranks 2 and 1 micro-batches in every training and validation step (asserted). Every value is
compared with an independent single-process reference: a plain Hugging Face model, one sequence
at a time, token cross-entropy summed and divided by the global batch's supervised tokens; in
float32 to float32 rounding, in ``bf16-mixed`` by the 16-bit rule of
tests/strategies/test_precision_matrix.py (at most ``RATIO`` x the distance of the same reference under bf16
autocast, plus ``FLOOR``), except what must be exact in any precision: a resumed run equals the
uninterrupted run, and the learning-rate finder gives the weights back bit for bit. The spawn
also resumes a ``max_time`` stop under ``SkrullFSDPStrategy`` in ``bf16-mixed``.
"""

from __future__ import annotations

import csv
import functools
import itertools
import math
import os
import weakref
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import torchmetrics
from helpers import (
    VOCAB,
    BatchRecorder,
    PlainLM,
    bf16_policy_training,
    count_exchanged_bytes,
    cpu_trainer,
    model_flops,
    one_thread,
    prompted_samples,
    reference_logits,
    reference_model,
    skrull_strategy,
    tiny_qwen2,
    trained_params,
)
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    EarlyStopping,
    ModelCheckpoint,
    OnExceptionCheckpoint,
    ThroughputMonitor,
    Timer,
)
from lightning.pytorch.loggers import CSVLogger, Logger
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.tuner import Tuner
from precision_rule import FLOOR, RATIO, relative_distance, update
from torch.utils.flop_counter import FlopCounterMode
from transformers import Qwen2ForCausalLM

from lightning_skrull.runtime.launch import spawn

LENGTHS = (60, 60, 60, 2, 2)
"""One global batch. At CP=2 with a 32-token bucket the planner gives DP rank 0 two
micro-batches (one 60-token sequence each, sharded) and DP rank 1 one (a 60-token sequence
sharded, the two short ones whole on one CP rank each)."""
CP, BUCKET, STEPS, LR = 2, 32, 2, 0.5
CLIP = 0.05  # below the gradient norm of these steps (asserted), so clipping changes the update
# gradient_clip_algorithm="value": between the smallest and the largest gradient entry of every
# step (asserted), so the clip changes some entries and leaves others
CLIP_VALUE = 1e-3
# the monitored run: 2 training batches per epoch (limit_train_batches of 3 in the data), a
# validation after every step; the validation loss falls after step 2 and rises after step 3
# (asserted), so EarlyStopping(patience=1) stops after step 3 and the best checkpoint is step 2's
MONITORED_BATCHES, MONITORED_LIMIT, BEST, STOP_AFTER = 3, 2, 2, 3
# the smallest change between the validation losses the decisions rest on (measured 3.3e-4
# and 7.6e-4), far above the difference between the run's synced loss and the reference's
# (VALUE_REL): the decisions cannot flip on summation order
DECISION_MARGIN = 1e-4
# float32: the packed, sharded computation sums the same terms in another order than the
# reference and DDP averages over 4 ranks; parameters agree to a few ulps (measured ~3e-8).
PARAM_ATOL = 2e-6
# a loss, a token accuracy or a gradient norm from float32 sums in another order (measured
# differences below 1e-6 relative)
VALUE_REL = 1e-5
# the runs of the other habits (learning-rate finder, max_time, OnExceptionCheckpoint, anomaly
# detection, deterministic algorithms, the profiler, a CSVLogger): 4 global batches, SGD of LR,
# no clipping; max_time runs out after TIMER_STOP steps, the module raises in step RAISE_AT
# (0-based), and the CSVLogger writes every LOG_EVERY steps
HABIT_STEPS, TIMER_STOP, RAISE_AT, LOG_EVERY = 4, 1, 2, 2
OVERFIT_EPOCHS = 2  # Trainer(overfit_batches=1): the first global batch, once per epoch
# a second trainer.fit on the same Trainer, one epoch more: SECOND_FIT_BATCHES global batches of
# shuffled data per epoch (limit_train_batches)
SECOND_FIT_BATCHES = 2
Batch = int | tuple[int, ...]
"""A step of :func:`habit_reference`: a global batch in dataset order, or sample indices."""
# SkippingLM: rank SKIP_RANK ends epoch 0 after its first batch; 2 batches per epoch after it
SKIP_RANK, SKIPPED_BATCHES = 3, (0, 0, 1)
# PhasedFinetuning: 2 epochs of the first 2 global batches in dataset order; the embeddings are
# frozen in the first epoch, the LM head in the second
PHASED_BATCHES: tuple[Batch, ...] = (0, 1, 0, 1)
PHASED_FROZEN = (("model.embed_tokens.weight",),) * 2 + (("lm_head.weight",),) * 2
LR_FINDER_BETA = 0.98  # the smoothing of Lightning's learning-rate finder (its default)
# a resumed run against the uninterrupted run of its precision: the same micro-batches on the
# same float32 weights, but DDP rebuilds its gradient buckets after the first step of each run,
# so in the resumed run's first step gloo's ring all-reduce adds each element's terms in another
# order (docs/precision.md, "Resume in bf16-mixed"); measured 7.5e-9 (float32) and 3.7e-9
# (bf16-mixed), the losses equal
RESUME_ATOL = 1e-7


def make_data(num_batches: int, seed: int) -> list[dict[str, list[int]]]:
    """``num_batches`` global batches of :data:`LENGTHS`; the first few tokens of the long
    samples are an unsupervised prompt."""
    return prompted_samples(LENGTHS * num_batches, seed)


class HabitsLM(L.LightningModule):
    """Logs as Lightning users do, and records what its hooks see."""

    def __init__(self, gather: bool = False) -> None:
        super().__init__()
        self.model = tiny_qwen2()
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=VOCAB, average="micro", ignore_index=-100
        )
        self.gather = gather
        # (rank, step): sets trainer.should_stop in training_step on that rank in that step
        self.stop_at: tuple[int, int] | None = None
        self.before_backward: list[float] = []
        self.after_backward_norms: list[float] = []
        self.before_step_norms: list[float] = []

    def _token_stats(self, out: Any, batch: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        target = batch["shift_labels"][0]
        mask = target != -100
        pred = out.logits[0].argmax(-1)
        correct = (pred[mask] == target[mask]).float()
        acc = correct.mean() if bool(mask.any()) else torch.zeros(())
        return acc, mask.sum().float(), pred, target

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if (self.global_rank, self.global_step) == self.stop_at:  # a NaN guard, say, fired
            self.trainer.should_stop = True
        out = self.model(**batch)
        acc, supervised, _, _ = self._token_stats(out, batch)
        if self.gather:
            self.all_gather(out.loss.detach())
        self.log("user_loss", out.loss, sync_dist=True, prog_bar=True)
        self.log("token_acc", acc, sync_dist=True)
        self.log("supervised", supervised, reduce_fx="sum", sync_dist=True)
        self.log_dict({"dict_loss": out.loss, "dict_acc": acc}, sync_dist=True)
        return {"loss": out.loss, "acc": acc.detach()}

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self.model(**batch)
        _, _, pred, target = self._token_stats(out, batch)
        self.val_acc.update(pred, target)
        self.log("val_loss", out.loss, sync_dist=True)  # the most common Lightning line
        self.log("val_acc", self.val_acc)
        self.log_dict({"dict_val_loss": out.loss}, sync_dist=True)
        return out.loss

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self.model(**batch).loss, sync_dist=True, on_step=True)

    def _grad_norm(self) -> float:
        grads = [p.grad.float() for p in self.parameters() if p.grad is not None]
        return float(torch.stack([g.pow(2).sum() for g in grads]).sum().sqrt())

    def on_before_backward(self, loss: torch.Tensor) -> None:
        self.before_backward.append(float(loss.detach()))

    def on_after_backward(self) -> None:
        self.after_backward_norms.append(self._grad_norm())

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before_step_norms.append(self._grad_norm())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)

    # ThroughputMonitor reads flops_per_batch after each step: the FLOPs of the step's batch
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.flops_per_batch = batch.flops_per_device()

    def on_validation_batch_start(self, batch: Any, batch_idx: int, idx: int = 0) -> None:
        self.flops_per_batch = batch.flops_per_device(backward=False)

    def on_test_batch_start(self, batch: Any, batch_idx: int, idx: int = 0) -> None:
        self.flops_per_batch = batch.flops_per_device(backward=False)


def throughput_monitor() -> ThroughputMonitor:
    """Lightning's monitor as the docs configure it; a window of 2 updates, so the rates of the
    second step come out."""
    return ThroughputMonitor(
        batch_size_fn=lambda batch: batch.sequences_per_device,
        length_fn=lambda batch: batch.tokens_per_device,
        window_size=2,
    )


class Recorder(L.Callback):
    """What callbacks see per step: logged values, outputs and micro-batch counts."""

    def __init__(self) -> None:
        self.train: list[dict[str, Any]] = []
        self.val: list[dict[str, Any]] = []

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int
    ) -> None:
        metrics = trainer.callback_metrics
        self.train.append(
            {
                "user_loss": float(metrics["user_loss"]),
                "train_loss": float(metrics["train_loss"]),
                "token_acc": float(metrics["token_acc"]),
                "supervised": float(metrics["supervised"]),
                "dict_loss": float(metrics["dict_loss"]),
                "dict_acc": float(metrics["dict_acc"]),
                "output_loss": float(outputs["loss"]),
                "output_acc": [float(a) for a in outputs["acc"]],
                "run": len(batch.rank_batch.micro_batches),
                "max": batch.stats.max_micro_batches,
                "min": batch.stats.min_micro_batches,
                "skrull_keys": sorted(k for k in metrics if k.startswith("skrull/")),
            }
        )

    def on_validation_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int, *args: Any
    ) -> None:
        self.val.append(
            {
                "output": float(outputs),
                "run": len(batch.rank_batch.micro_batches),
                "max": batch.stats.max_micro_batches,
                "min": batch.stats.min_micro_batches,
            }
        )


class MemoryLogger(Logger):
    """A Lightning logger that keeps every ``log_metrics`` call: ``(step, metrics)``."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int | None, dict[str, float]]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.rows.append((step, dict(metrics)))


def _trainer(**kwargs: Any) -> L.Trainer:
    from lightning_skrull import SkrullStrategy

    # the module computes token accuracy from the logits: the dense loss returns them
    strategy = SkrullStrategy(cp_size=CP, bucket_size=BUCKET, chunked_loss=False)
    return cpu_trainer(strategy, **kwargs)  # type: ignore[no-any-return]


def _data() -> Any:
    from lightning_skrull import SkrullDataModule

    return SkrullDataModule(
        train_data=make_data(STEPS, seed=0),
        val_data=make_data(1, seed=1),
        test_data=make_data(1, seed=2),
        global_batch_size=len(LENGTHS),
        val_global_batch_size=len(LENGTHS),
        shuffle=False,
    )


class ValidationRecorder(L.Callback):
    """The synced ``val_loss`` of every validation, with the step it followed."""

    def __init__(self) -> None:
        self.val_losses: list[tuple[int, float]] = []

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        self.val_losses.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))


def _monitored_fit(checkpoint_dir: str) -> dict[str, Any]:
    """Clip by value, stop early and keep the best checkpoint on ``val_loss``, with an epoch
    cut short by ``limit_train_batches`` and a validation after every step."""
    from lightning_skrull import SkrullDataModule

    recorder, validations = Recorder(), ValidationRecorder()
    # checked after every validation (with val_check_interval=1 Lightning would check at the
    # epochs' ends only)
    stopping = EarlyStopping(monitor="val_loss", patience=1, check_on_train_epoch_end=False)
    checkpoint = ModelCheckpoint(dirpath=checkpoint_dir, monitor="val_loss", save_top_k=1)
    module = HabitsLM()
    trainer = _trainer(
        max_epochs=MONITORED_BATCHES,
        limit_train_batches=MONITORED_LIMIT,
        val_check_interval=1,
        limit_val_batches=1,
        gradient_clip_val=CLIP_VALUE,
        gradient_clip_algorithm="value",
        callbacks=[recorder, validations, stopping, checkpoint],
        enable_checkpointing=True,
    )
    data = SkrullDataModule(
        train_data=make_data(MONITORED_BATCHES, seed=0),
        val_data=make_data(1, seed=1),
        global_batch_size=len(LENGTHS),
        val_global_batch_size=len(LENGTHS),
        shuffle=False,
    )
    trainer.fit(module, data)
    best = checkpoint.best_model_score
    assert best is not None
    return {
        "train": recorder.train,
        "val_losses": validations.val_losses,
        "global_step": trainer.global_step,
        "stopped_epoch": stopping.stopped_epoch,
        "best_score": float(best),
        "best_path": os.path.basename(checkpoint.best_model_path),
        "checkpoints": sorted(os.listdir(checkpoint_dir)),
        "params": {
            k: v.detach().float().numpy().copy() for k, v in module.model.state_dict().items()
        },
    }


SHARDED = ("zero2", "fsdp", "fsdp_world")
"""The sharding strategies the logs and hooks also run under (helpers.skrull_strategy names)."""


class ShardedHabitsLM(HabitsLM):
    """:class:`HabitsLM` whose backward hooks record whether they see gradients (ZeRO-2 keeps
    them inside DeepSpeed: ``.grad`` is ``None``; FSDP's are sharded DTensors), not norms."""

    def on_after_backward(self) -> None:
        self.after_backward_norms.append(float(any(p.grad is not None for p in self.parameters())))

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.before_step_norms.append(float(any(p.grad is not None for p in self.parameters())))


def _sharded_habits(name: str) -> dict[str, Any]:
    """The 32-true habits fit under a sharding strategy (clipped, validated once, the module's
    self.log calls), its logs, hook calls and the full weights (rank 0's, under FSDP). Rank 1
    alone sets ``trainer.should_stop`` in the last step's ``training_step`` of the STEPS the
    tests expect: every rank must stop there, before ``max_steps``."""
    recorder, module = Recorder(), ShardedHabitsLM()
    strategy = skrull_strategy(name, cp_size=CP, bucket_size=BUCKET, chunked_loss=False)
    trainer = cpu_trainer(
        strategy,
        max_steps=STEPS + 2,
        callbacks=[recorder, StopOnOneRank("training_step", 1, STEPS - 1)],
        gradient_clip_val=CLIP,
        limit_val_batches=1,
        val_check_interval=STEPS,
    )
    trainer.fit(module, _data())
    return {
        "train": recorder.train,
        "val": recorder.val,
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_acc": float(trainer.callback_metrics["val_acc"]),
        "before_backward": module.before_backward,
        "grads_after_backward": module.after_backward_norms,
        "grads_before_step": module.before_step_norms,
        "params": trained_params(module.model, trainer.strategy),
    }


def _habit_cases(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {"monitored": _monitored_fit(checkpoint_dir)}
    for precision in ("32-true", "bf16-mixed"):
        recorder, logger = Recorder(), MemoryLogger()
        module = HabitsLM()
        trainer = _trainer(
            max_steps=STEPS,
            callbacks=[recorder, throughput_monitor()],
            logger=logger,
            log_every_n_steps=2,  # the loggers get the second (last) step only
            gradient_clip_val=CLIP,
            precision=precision,
            limit_val_batches=1,
            val_check_interval=STEPS,
        )
        with count_exchanged_bytes() as exchanged:
            trainer.fit(module, _data())
        out[precision] = {
            "exchanged_dtypes": sorted(str(d) for d in exchanged.dtypes),
            "exchanged_bytes": exchanged.total_bytes(),
            "train": recorder.train,
            "val": recorder.val,
            "logged": [(step, m) for step, m in logger.rows if "train_loss" in m],
            "throughput": [(step, m) for step, m in logger.rows if any("/samples" in k for k in m)],
            "val_loss": float(trainer.callback_metrics["val_loss"]),
            "val_acc": float(trainer.callback_metrics["val_acc"]),
            "dict_val_loss": float(trainer.callback_metrics["dict_val_loss"]),
            "before_backward": module.before_backward,
            "after_backward_norms": module.after_backward_norms,
            "before_step_norms": module.before_step_norms,
            "params": {
                k: v.detach().float().numpy().copy() for k, v in module.model.state_dict().items()
            },
        }
        if precision == "32-true":
            test_logger = MemoryLogger()
            tester = _trainer(
                callbacks=[throughput_monitor()], logger=test_logger, log_every_n_steps=1
            )
            out["test_loss"] = float(tester.test(module, _data())[0]["test_loss_epoch"])
            out["test_throughput"] = [m for _, m in test_logger.rows if "test/samples" in m]
    try:
        _trainer(max_steps=1).fit(HabitsLM(gather=True), _data())
        out["gather_error"] = None
    except RuntimeError as err:
        out["gather_error"] = str(err)
    for precision, key in (("32-true", "other"), ("bf16-mixed", "other_bf16")):
        out[key] = _other_habits(os.path.join(checkpoint_dir, key), precision)
    out["fsdp_max_time"] = _fsdp_max_time(os.path.join(checkpoint_dir, "fsdp"))
    for name in SHARDED:
        out[name] = _sharded_habits(name)
    for precision in ("32-true", "bf16-mixed"):
        out[f"fsdp_phased/{precision}"] = _fsdp_phased(precision)
    return out


def _fsdp_phased(precision: str) -> dict[str, Any]:
    """The ``BaseFinetuning`` run of :func:`_other_habits` under ``SkrullFSDPStrategy`` in
    ``precision``: the full weights (rank 0's) and what the recorder saw."""
    module, recorder = HabitsLM(), Recorder()
    strategy = skrull_strategy("fsdp", cp_size=CP, bucket_size=BUCKET, chunked_loss=False)
    trainer = cpu_trainer(
        strategy,
        max_epochs=2,
        limit_train_batches=2,
        limit_val_batches=0,
        callbacks=[recorder, PhasedFinetuning()],
        precision=precision,
    )
    trainer.fit(module, _validated_data(False))
    return {"params": trained_params(module.model, trainer.strategy), "train": recorder.train}


def _habit_data() -> Any:
    from lightning_skrull import SkrullDataModule

    return SkrullDataModule(
        train_data=make_data(HABIT_STEPS, seed=0), global_batch_size=len(LENGTHS), shuffle=False
    )


def _state(module: L.LightningModule) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in module.model.state_dict().items()}


class RaisingLM(HabitsLM):
    """Raises in the first micro-batch of step :data:`RAISE_AT`, on every rank."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> Any:
        if self.global_step == RAISE_AT:
            raise RuntimeError("raised in training_step")
        return super().training_step(batch, batch_idx)


class OverridingLM(HabitsLM):
    """Overrides ``optimizer_step`` (the form of Lightning's docs, e.g. for a hand-made warm-up:
    ``optimizer.step(closure=optimizer_closure)``) and ``optimizer_zero_grad`` (zeros instead
    of ``None``), counting their calls, and reads ``trainer.estimated_stepping_batches`` in
    ``configure_optimizers`` (where schedules read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"optimizer_step": 0, "optimizer_zero_grad": 0}
        self.estimated_steps: float | None = None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        self.estimated_steps = self.trainer.estimated_stepping_batches
        return super().configure_optimizers()

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None
    ) -> None:
        self.calls["optimizer_step"] += 1
        optimizer.step(closure=optimizer_closure)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
        self.calls["optimizer_zero_grad"] += 1
        optimizer.zero_grad(set_to_none=False)


class PhasedFinetuning(BaseFinetuning):
    """Lightning's ``BaseFinetuning`` as its docs use it: the embeddings frozen before the fit
    and unfrozen into a parameter group of their own when epoch 1 starts, where the LM head is
    frozen instead (:data:`PHASED_FROZEN`). Records, at that epoch's end, whether the module
    runs in another DDP wrapper than in epoch 0 and whether the first one is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.first_wrapper: Any = None
        self.wrappers: dict[str, bool] = {}

    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.model.model.embed_tokens)

    def finetune_function(self, pl_module: Any, current_epoch: int, optimizer: Any) -> None:
        if current_epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.model.model.embed_tokens, optimizer, lr=LR)
            self.freeze(pl_module.model.lm_head)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.first_wrapper = weakref.ref(trainer.strategy.model)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        if trainer.current_epoch == 1:
            first = self.first_wrapper()
            self.wrappers = {
                "first_alive": first is not None,
                "rewrapped": first is not trainer.strategy.model,
            }


class SkippingLM(HabitsLM):
    """Returns ``-1`` from ``on_train_batch_start`` (skip the rest of the epoch) on global rank
    :data:`SKIP_RANK` only, at batch 1 of epoch 0."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        super().on_train_batch_start(batch, batch_idx)
        if (self.global_rank, self.current_epoch, batch_idx) == (SKIP_RANK, 0, 1):
            return -1
        return None


class StopOnOneRank(L.Callback):
    """Sets ``trainer.should_stop`` on global rank ``rank`` only, in step ``step`` (from 0): in
    ``training_step`` (through the module's ``stop_at``), at the end of a validation after it, or
    at the end of an epoch ending with it."""

    def __init__(self, where: str, rank: int, step: int = 0) -> None:
        self.where, self.rank, self.step = where, rank, step

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self.where == "training_step":
            module.stop_at = (self.rank, self.step)

    def _stop(self, trainer: Any, where: str) -> None:
        here = (self.where, self.rank, self.step + 1)
        if here == (where, trainer.global_rank, trainer.global_step):
            trainer.should_stop = True

    def on_validation_end(self, trainer: Any, module: Any) -> None:
        if not trainer.sanity_checking:
            self._stop(trainer, "validation_end")

    def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
        self._stop(trainer, "epoch_end")


class HourPasses(L.Callback):
    """Moves the Trainer's ``Timer`` an hour on when :data:`TIMER_STOP` steps have run, so that
    ``max_time`` runs out there, whatever the machine's speed."""

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == TIMER_STOP:
            (timer,) = [c for c in trainer.callbacks if isinstance(c, Timer)]
            timer._start_time[RunningStage.TRAINING] -= 3600.0


def _other_habits(root: str, precision: str) -> dict[str, Any]:
    """The learning-rate finder, max_time, OnExceptionCheckpoint and resuming from what they
    leave, and one run with detect_anomaly, deterministic, the simple profiler and a CSVLogger,
    every Trainer in ``precision``; files under ``root``."""
    out: dict[str, Any] = {}
    trainer_in = functools.partial(_trainer, precision=precision)
    # Tuner.lr_find, then a fit on the same Trainer: it must start from the restored weights
    # and the first global batch
    module, recorder = HabitsLM(), Recorder()
    initial = _state(module)
    trainer = trainer_in(max_steps=STEPS, callbacks=[recorder], default_root_dir=root)
    found = Tuner(trainer).lr_find(
        module, datamodule=_habit_data(), min_lr=0.05, max_lr=0.5, num_training=STEPS,
        early_stop_threshold=None, update_attr=False,
    )  # fmt: skip
    assert found is not None
    out["lr_find"] = {"lr": found.results["lr"], "loss": found.results["loss"]}
    out["lr_find_restored"] = _state(module)
    out["lr_find_initial"] = initial
    trainer.fit(module, _habit_data())
    out["after_lr_find"] = {"params": _state(module), "train": recorder.train}
    # max_time runs out mid-epoch; the checkpoint of that step resumes the run (one written at
    # the end of the stopped epoch records the epoch as finished: resuming starts the next)
    stopped = os.path.join(root, "max_time")
    recorder = Recorder()
    trainer_in(
        max_time={"hours": 1}, max_epochs=1, callbacks=[HourPasses(), recorder,
        ModelCheckpoint(dirpath=stopped, every_n_train_steps=1)], enable_checkpointing=True,
    ).fit(HabitsLM(), _habit_data())  # fmt: skip
    out["max_time"] = {"steps": len(recorder.train), "files": sorted(os.listdir(stopped))}
    (written,) = os.listdir(stopped)
    module, recorder = HabitsLM(), Recorder()
    trainer_in(max_steps=HABIT_STEPS, callbacks=[recorder]).fit(
        module, _habit_data(), ckpt_path=os.path.join(stopped, written)
    )
    out["max_time"].update(params=_state(module), resumed=recorder.train)
    # a run raising mid-fit leaves on_exception.ckpt, which resumes the run
    raised = os.path.join(root, "exception")
    recorder = Recorder()
    try:
        trainer_in(
            max_steps=HABIT_STEPS,
            callbacks=[recorder, OnExceptionCheckpoint(raised)],
            enable_checkpointing=True,
        ).fit(RaisingLM(), _habit_data())
        out["exception"] = {"error": None}
    except RuntimeError as err:
        out["exception"] = {"error": str(err), "steps": len(recorder.train)}
    out["exception"]["files"] = sorted(os.listdir(raised))
    module, recorder = HabitsLM(), Recorder()
    trainer_in(max_steps=HABIT_STEPS, callbacks=[recorder]).fit(
        module, _habit_data(), ckpt_path=os.path.join(raised, "on_exception.ckpt")
    )
    out["exception"].update(params=_state(module), resumed=recorder.train)
    # detect_anomaly, deterministic algorithms, the simple profiler and a CSVLogger in one run,
    # with optimizer_step and optimizer_zero_grad overridden as Lightning's docs show
    module, recorder = OverridingLM(), Recorder()
    logged = os.path.join(root, "csv")
    trainer = trainer_in(
        max_epochs=1, callbacks=[recorder], detect_anomaly=True, deterministic=True,
        profiler="simple", logger=CSVLogger(logged, name="", version=""),
        log_every_n_steps=LOG_EVERY,
    )  # fmt: skip
    trainer.fit(module, _habit_data())
    profiled = trainer.profiler.recorded_durations  # type: ignore[attr-defined]
    out["flags"] = {
        "params": _state(module),
        "train": recorder.train,
        "training_steps": {k: len(v) for k, v in profiled.items() if k.endswith("training_step")},
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "overrides": module.calls,
        "estimated_steps": module.estimated_steps,
    }
    # Lightning leaves deterministic algorithms on: the next precision's runs start as these did
    torch.use_deterministic_algorithms(False)
    if trainer.is_global_zero:  # loggers write on rank 0
        with open(os.path.join(logged, "metrics.csv")) as f:
            out["flags"]["csv"] = list(csv.DictReader(f))
    # overfit_batches on shuffled data: the first global batch in dataset order every epoch,
    # and the first validation batch after each; fast_dev_run: one step and one validation
    for habit, flags, shuffle in (
        ("overfit", {"overfit_batches": 1, "max_epochs": OVERFIT_EPOCHS}, True),
        ("fast_dev_run", {"fast_dev_run": True}, False),
    ):
        module, recorder = HabitsLM(), Recorder()
        trainer_in(callbacks=[recorder], **flags).fit(module, _validated_data(shuffle))
        out[habit] = {"params": _state(module), "train": recorder.train, "val": recorder.val}
    # a second fit on the same Trainer, as a notebook trains one epoch more: it goes on from the
    # weights and the epoch the first left, with that epoch's shuffled order
    module, recorder = HabitsLM(), Recorder()
    trainer = trainer_in(
        max_epochs=1, limit_train_batches=SECOND_FIT_BATCHES, limit_val_batches=0,
        callbacks=[recorder],
    )  # fmt: skip
    data = _validated_data(True)
    trainer.fit(module, data)
    trainer.fit_loop.max_epochs = 2
    trainer.fit(module, data)
    out["second_fit"] = {
        "params": _state(module),
        "train": recorder.train,
        "global_step": trainer.global_step,
    }
    # BaseFinetuning: the embeddings unfrozen and the LM head frozen when epoch 1 starts
    module, recorder, phased = HabitsLM(), Recorder(), PhasedFinetuning()
    trainer = trainer_in(
        max_epochs=2, limit_train_batches=2, limit_val_batches=0, callbacks=[recorder, phased]
    )
    trainer.fit(module, _validated_data(False))
    out["phased"] = {"params": _state(module), "train": recorder.train, **phased.wrappers}
    # on_train_batch_start returns -1 on one rank only: every rank skips the rest of the epoch
    module, recorder = SkippingLM(), Recorder()
    trainer = trainer_in(
        max_epochs=2, limit_train_batches=2, limit_val_batches=0, callbacks=[recorder]
    )
    trainer.fit(module, _validated_data(False))
    out["skip"] = {
        "params": _state(module),
        "train": recorder.train,
        "global_step": trainer.global_step,
        "hook_left_wrapped": "on_train_batch_start" in vars(module),
    }
    # trainer.should_stop set on one rank only, in the first step: every rank stops after it
    for where, rank, flags in (
        ("training_step", 1, {"val_check_interval": HABIT_STEPS}),
        ("validation_end", 0, {"val_check_interval": 1}),
        ("epoch_end", 3, {"limit_train_batches": 1, "limit_val_batches": 0}),
    ):
        module, recorder = HabitsLM(), Recorder()
        trainer = trainer_in(
            max_epochs=HABIT_STEPS, callbacks=[recorder, StopOnOneRank(where, rank)], **flags
        )
        trainer.fit(module, _validated_data(False))
        out[f"stop_{where}"] = {
            "params": _state(module),
            "train": recorder.train,
            "val": recorder.val,
            "global_step": trainer.global_step,
        }
    return out


def _validated_data(shuffle: bool) -> Any:
    """The other habits' training data, and a validation set of 2 global batches."""
    from lightning_skrull import SkrullDataModule

    return SkrullDataModule(
        train_data=make_data(HABIT_STEPS, seed=0),
        val_data=make_data(2, seed=1),
        global_batch_size=len(LENGTHS),
        val_global_batch_size=len(LENGTHS),
        shuffle=shuffle,
    )


def _fsdp_max_time(root: str) -> dict[str, Any]:
    """``max_time`` under ``SkrullFSDPStrategy`` in ``"bf16-mixed"``: the run stopped after
    :data:`TIMER_STOP` steps, resumed from its sharded checkpoint, and the same fit run without
    stopping; the full weights on rank 0 (``{}`` elsewhere)."""
    from lightning_skrull import SkrullFSDPStrategy

    def fsdp_trainer(**kwargs: Any) -> L.Trainer:
        strategy = SkrullFSDPStrategy(cp_size=CP, bucket_size=BUCKET)
        return cpu_trainer(strategy, precision="bf16-mixed", **kwargs)  # type: ignore[no-any-return]

    def weights(trainer: L.Trainer) -> dict[str, np.ndarray]:
        state = trainer.strategy.full_state_dict()  # type: ignore[attr-defined]
        return {k: v.detach().float().numpy().copy() for k, v in state.items()}

    stopped_dir, recorder = os.path.join(root, "max_time"), BatchRecorder()
    stopped = fsdp_trainer(
        max_time={"hours": 1}, max_epochs=1, callbacks=[HourPasses(), recorder,
        ModelCheckpoint(dirpath=stopped_dir, every_n_train_steps=1)], enable_checkpointing=True,
    )  # fmt: skip
    stopped.fit(PlainLM(), _habit_data())
    out: dict[str, Any] = {"steps": len(recorder.steps), "stopped_params": weights(stopped)}
    out["files"] = sorted(os.listdir(stopped_dir))
    runs: dict[str, str | None] = {"resumed": os.path.join(stopped_dir, out["files"][0])}
    runs["whole"] = None
    for name, ckpt_path in runs.items():
        recorder = BatchRecorder()
        trainer = fsdp_trainer(max_steps=HABIT_STEPS, callbacks=[recorder])
        trainer.fit(PlainLM(), _habit_data(), ckpt_path=ckpt_path)
        out[name] = {"steps": recorder.steps, "params": weights(trainer)}
    return out


# ----------------------------------------------------------------------------- reference
def _batch_terms(
    model: Qwen2ForCausalLM, samples: list[dict[str, list[int]]]
) -> tuple[torch.Tensor, int, int]:
    """(summed token loss, supervised tokens, correctly predicted tokens) of ``samples``."""
    total, tokens, correct = torch.zeros(()), 0, 0
    for sample in samples:
        logits, target = reference_logits(model, sample)
        total = total + torch.nn.functional.cross_entropy(
            logits, target, ignore_index=-100, reduction="sum"
        )
        mask = target != -100
        tokens += int(mask.sum())
        correct += int((logits.argmax(-1)[mask] == target[mask]).sum())
    return total, tokens, correct


@functools.cache
def reference(autocast: bool = False) -> dict[str, Any]:
    """Plain HF training with clipping on the same global batches, one process; the forward
    under ``torch.autocast("cpu", bfloat16)`` with ``autocast`` (float32 weights, gradients and
    SGD: the single-process reference of ``"bf16-mixed"``)."""
    data = make_data(STEPS, seed=0)
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    steps = []
    size = len(LENGTHS)
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            total, tokens, correct = _batch_terms(model, data[step * size : (step + 1) * size])
        loss = total / tokens
        optimizer.zero_grad()
        loss.backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        optimizer.step()
        steps.append({"loss": float(loss), "tokens": tokens, "acc": correct / tokens, "norm": norm})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        val_total, val_tokens, val_correct = _batch_terms(model, make_data(1, seed=1))
        test_total, test_tokens, _ = _batch_terms(model, make_data(1, seed=2))
    return {
        "steps": steps,
        "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
        "val_loss": float(val_total) / val_tokens,
        "val_acc": val_correct / val_tokens,
        "test_loss": float(test_total) / test_tokens,
    }


@functools.cache
def habit_reference(
    lrs: tuple[float, ...],
    autocast: bool = False,
    batches: tuple[Batch, ...] | None = None,
    frozen: tuple[tuple[str, ...], ...] | None = None,
) -> dict[str, Any]:
    """Plain HF SGD on one process over the first ``len(lrs)`` global batches of the other
    habits' data (or ``batches[k]`` in step ``k``: a global batch in dataset order, or the
    samples of that index), learning rate
    ``lrs[k]`` in step ``k``, the parameters named in ``frozen[k]`` frozen in step ``k`` (no
    gradient: SGD leaves them), no clipping, the forward under ``torch.autocast("cpu", bfloat16)``
    with ``autocast`` (what ``"bf16-mixed"`` runs on CPU, float32 weights and SGD): the loss of
    each step, the parameters before the first step (``start``) and after each, and the
    supervised and correctly predicted tokens of each."""
    data = make_data(HABIT_STEPS, seed=0)
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    size = len(LENGTHS)
    start = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    losses, params, supervised, correct = [], [], [], []
    order = range(len(lrs)) if batches is None else batches
    with one_thread():
        for step, (lr, b) in enumerate(zip(lrs, order, strict=True)):
            for name, p in model.named_parameters():
                p.requires_grad_(frozen is None or name not in frozen[step])
            chosen = (
                [data[i] for i in b] if isinstance(b, tuple) else data[b * size : (b + 1) * size]
            )
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                total, tokens, right = _batch_terms(model, chosen)
            loss = total / tokens
            optimizer.zero_grad()
            loss.backward()
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            losses.append(float(loss.detach()))
            supervised.append(tokens)
            correct.append(right)
            params.append({k: v.detach().numpy().copy() for k, v in model.state_dict().items()})
    return {
        "losses": losses,
        "start": start,
        "params": params,
        "tokens": supervised,
        "correct": correct,
    }


@functools.cache
def monitored_reference() -> dict[str, Any]:
    """What the monitored run does on one process: the epoch's first ``MONITORED_LIMIT``
    global batches again and again, each step clipped by value (``clip_grad_value_``), the
    validation loss after every step, ``STOP_AFTER`` steps."""
    data = make_data(MONITORED_BATCHES, seed=0)
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    size = len(LENGTHS)
    val_losses, clipped, kept = [], [], []
    for step in range(STOP_AFTER + 1):  # one step past the stop: the stop must be the decision
        batch = step % MONITORED_LIMIT
        total, tokens, _ = _batch_terms(model, data[batch * size : (batch + 1) * size])
        optimizer.zero_grad()
        (total / tokens).backward()
        grads = torch.cat(
            [p.grad.abs().flatten() for p in model.parameters() if p.grad is not None]
        )
        clipped.append(int((grads > CLIP_VALUE).sum()))
        kept.append(int(((grads > 0) & (grads < CLIP_VALUE)).sum()))
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        optimizer.step()
        if step == STOP_AFTER - 1:
            params = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
        with torch.no_grad():
            val_total, val_tokens, _ = _batch_terms(model, make_data(1, seed=1))
        val_losses.append(float(val_total) / val_tokens)
    return {"params": params, "val_losses": val_losses, "clipped": clipped, "kept": kept}


def reference_forward_flops(model: Qwen2ForCausalLM, length: int) -> float:
    """Forward FLOPs of one ``length``-token sequence through the plain HF model with eager
    attention, counted by torch's FLOP counter, with the attention matmuls (which eager
    attention computes over all ``length**2`` pairs and masks) counted over the causal
    ``length * (length + 1) / 2`` pairs."""
    with FlopCounterMode(display=False) as counter:
        model(input_ids=torch.zeros(1, length, dtype=torch.long))
    attention = sum(
        counts.get(torch.ops.aten.bmm, 0)
        for name, counts in counter.get_flop_counts().items()
        if name.endswith("self_attn")
    )
    assert attention > 0  # the attention matmuls were found and are replaced below
    return model_flops(counter) - attention + attention * (length + 1) / (2 * length)


def _max_diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    checkpoint_dir = str(tmp_path_factory.mktemp("habits_checkpoints"))
    return spawn(_habit_cases, 4, checkpoint_dir, timeout=600)


@pytest.mark.multiprocess
def test_micro_batch_counts_differ_between_dp_ranks(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for step in out["32-true"]["train"] + out["32-true"]["val"]:
            assert (step["max"], step["min"]) == (2, 1)
    # DP rank 0 (processes 0, 1) and DP rank 1 (processes 2, 3) ran different counts
    runs = [[s["run"] for s in out["32-true"]["train"]] for out in ranks]
    assert runs[0] == runs[1] and runs[2] == runs[3] and runs[0] != runs[2]


@pytest.mark.multiprocess
def test_synced_logs_equal_single_process_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    ref = reference()
    for out in ranks:
        for step, expected in zip(out["32-true"]["train"], ref["steps"], strict=True):
            # the model's loss, logged from every micro-batch: the sum of the shares, synced
            assert step["user_loss"] == pytest.approx(expected["loss"], rel=VALUE_REL)
            assert step["train_loss"] == pytest.approx(expected["loss"], rel=VALUE_REL)
            # a per-micro-batch mean: token-weighted over micro-batches and ranks
            assert step["token_acc"] == pytest.approx(expected["acc"], rel=VALUE_REL)
            # reduce_fx="sum": summed over micro-batches and ranks
            assert step["supervised"] == expected["tokens"]
            # self.log_dict goes through self.log
            assert step["dict_loss"] == pytest.approx(expected["loss"], rel=VALUE_REL)
            assert step["dict_acc"] == pytest.approx(expected["acc"], rel=VALUE_REL)
        assert out["32-true"]["val_loss"] == pytest.approx(ref["val_loss"], rel=VALUE_REL)
        assert out["32-true"]["dict_val_loss"] == pytest.approx(ref["val_loss"], rel=VALUE_REL)
        assert out["32-true"]["val_acc"] == pytest.approx(ref["val_acc"], rel=VALUE_REL)
        assert out["test_loss"] == pytest.approx(ref["test_loss"], rel=VALUE_REL)
    for key in ("user_loss", "token_acc"):  # the very same value on every rank
        assert len({tuple(s[key] for s in out["32-true"]["train"]) for out in ranks}) == 1


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SHARDED)
def test_logs_and_hooks_under_the_sharding_strategies_equal_single_process(
    ranks: list[dict[str, Any]], name: str
) -> None:
    """The same module, logs and clipping under ZeRO-2 and FSDP (over the CP group and over the
    world) as under DDP: every synced log, the validation values and the weights equal one
    process; the backward hooks run once per step; ``trainer.should_stop`` set on one rank in
    the last step stops every rank there. ZeRO-2 pads the DP ranks to equal
    micro-batch counts with empty micro-batches (they weigh nothing in the token means), so the
    planned counts differ (asserted) while both ranks run the larger."""
    ref = reference()
    for rank, out in enumerate(ranks):
        run = out[name]
        assert all((s["max"], s["min"]) == (2, 1) for s in run["train"])
        for step, expected in zip(run["train"], ref["steps"], strict=True):
            for key in ("user_loss", "train_loss", "dict_loss"):
                assert step[key] == pytest.approx(expected["loss"], rel=VALUE_REL), key
            for key in ("token_acc", "dict_acc"):
                assert step[key] == pytest.approx(expected["acc"], rel=VALUE_REL), key
            assert step["supervised"] == expected["tokens"]
        assert run["val_loss"] == pytest.approx(ref["val_loss"], rel=VALUE_REL)
        assert run["val_acc"] == pytest.approx(ref["val_acc"], rel=VALUE_REL)
        assert len(run["before_backward"]) == STEPS
        # once per step; ZeRO-2 keeps the gradients inside the engine
        seen = 0.0 if name == "zero2" else 1.0
        assert run["grads_after_backward"] == run["grads_before_step"] == [seen] * STEPS
        if run["params"]:  # the full weights: every rank but FSDP's non-zero ranks
            assert _max_diff(run["params"], ref["params"]) < PARAM_ATOL
        else:
            assert name.startswith("fsdp") and rank > 0
    runs = [[s["run"] for s in out[name]["train"]] for out in ranks]
    if name in ("zero2", "fsdp_world"):  # padded to the larger count on both DP ranks
        assert len({tuple(r) for r in runs}) == 1
    else:
        assert runs[0] != runs[2]


@pytest.mark.multiprocess
def test_throughput_monitor_reports_the_global_batch(ranks: list[dict[str, Any]]) -> None:
    model = reference_model()
    world = len(ranks)
    tokens = sum(LENGTHS)
    # model FLOPs per token of one global batch (forward + backward = 3 forwards), from the
    # plain model's counted FLOPs: independent of the package's FLOP formula
    flops_per_token = 3 * sum(reference_forward_flops(model, n) for n in LENGTHS) / tokens
    for precision in ("32-true", "bf16-mixed"):
        # loggers run on global rank 0 only; the monitor's figures do not depend on the rank
        rows = [metrics for _, metrics in ranks[0][precision]["throughput"]]
        # logged on the logging step only (log_every_n_steps=2), once the window holds 2 steps
        (train,) = [m for m in rows if "train/samples" in m]
        # device figures are the global batch over the 4 ranks, so the global figures (device x
        # world size) are the global batch's, though the DP ranks held 3 and 2 sequences
        assert train["train/batches"] == STEPS
        assert train["train/samples"] == pytest.approx(STEPS * len(LENGTHS) / world, rel=1e-12)
        assert train["train/lengths"] == pytest.approx(STEPS * tokens / world, rel=1e-12)
        assert train["train/items_per_sec"] == pytest.approx(
            world * train["train/device/items_per_sec"], rel=1e-12
        )
        # both rates share the window's time, so their ratio is FLOPs per token; the counter
        # and the package count the same integers, so only float rounding separates them
        ratio = train["train/device/flops_per_sec"] / train["train/device/items_per_sec"]
        assert ratio == pytest.approx(flops_per_token, rel=1e-9)
    # evaluation batches too (Lightning logs the monitor's validation figures only when the
    # step is a logging step; the test run logs every batch)
    (test,) = ranks[0]["test_throughput"]  # one test batch
    assert test["test/samples"] == pytest.approx(len(LENGTHS) / world, rel=1e-12)
    assert test["test/lengths"] == pytest.approx(tokens / world, rel=1e-12)


@pytest.mark.multiprocess
def test_plan_statistics_reach_the_loggers_on_logging_steps(ranks: list[dict[str, Any]]) -> None:
    """With ``log_every_n_steps=2`` the loggers get the second step: its loss and its plan's
    statistics (this rank's micro-batches differ between the DP ranks); the first step logs no
    plan statistics at all, as Lightning's LearningRateMonitor does off logging steps."""
    for out in ranks:
        for precision in ("32-true", "bf16-mixed"):
            train, logged = out[precision]["train"], out[precision]["logged"]
            assert train[0]["skrull_keys"] == []
            assert "skrull/plan_imbalance" in train[1]["skrull_keys"]
            assert [step for step, _ in logged] == [1]
            metrics = logged[0][1]
            assert metrics["train_loss"] == pytest.approx(train[1]["train_loss"], rel=1e-6)
            assert (metrics["skrull/micro_batches_max"], metrics["skrull/micro_batches_min"]) == (
                2,
                1,
            )
            assert metrics["skrull/micro_batches_rank"] == train[1]["run"]
            assert metrics["tokens_per_s"] > 0
    assert {out["32-true"]["logged"][0][1]["skrull/micro_batches_rank"] for out in ranks} == {1, 2}


@pytest.mark.multiprocess
def test_backward_hooks_run_once_per_step_and_see_the_whole_gradient(
    ranks: list[dict[str, Any]],
) -> None:
    ref = reference()
    for expected in ref["steps"]:
        assert expected["norm"] > CLIP  # clipping changes these updates
    for out in ranks:
        run = out["32-true"]
        assert len(run["before_backward"]) == STEPS
        # the whole step's gradient, averaged over the ranks: the single-process gradient
        for norms in (run["after_backward_norms"], run["before_step_norms"]):
            assert norms == pytest.approx([s["norm"] for s in ref["steps"]], rel=VALUE_REL)
        assert _max_diff(run["params"], ref["params"]) < PARAM_ATOL
    # on_before_backward gets the step's loss on this rank: the sum of its micro-batches'
    # shares, whose mean over the ranks is the global loss
    for step in range(STEPS):
        shares = [out["32-true"]["before_backward"][step] for out in ranks]
        assert sum(shares) / len(shares) == pytest.approx(ref["steps"][step]["loss"], rel=VALUE_REL)
        for out in ranks:
            assert out["32-true"]["train"][step]["output_loss"] == pytest.approx(
                out["32-true"]["before_backward"][step], rel=1e-6
            )


@pytest.mark.multiprocess
def test_callbacks_get_the_whole_step_outputs(ranks: list[dict[str, Any]]) -> None:
    ref = reference()
    for out in ranks:
        for step in out["32-true"]["train"]:
            # a non-loss value of the dict comes back once per micro-batch
            assert len(step["output_acc"]) == step["run"]
    # validation_step returned the model's loss: the outputs are the sum of the shares
    shares = [out["32-true"]["val"][0]["output"] for out in ranks]
    assert sum(shares) / len(shares) == pytest.approx(ref["val_loss"], rel=VALUE_REL)


@pytest.mark.multiprocess
def test_bf16_mixed_habits(ranks: list[dict[str, Any]]) -> None:
    """The bf16-mixed run's logged losses (each step's and the validation loss), clipped
    gradient norms and weights, each held to the 16-bit rule: relative distance to the float32
    reference at most RATIO x single-process bf16 autocast's own, plus FLOOR."""
    ref, autocast = reference(), reference(autocast=True)
    start = {k: v.detach().numpy().copy() for k, v in reference_model().state_dict().items()}
    delta_fp32 = update(start, ref["params"])
    update_bound = RATIO * relative_distance(update(start, autocast["params"]), delta_fp32) + FLOOR

    def values(steps: list[dict[str, Any]], key: str) -> list[float]:
        return [float(s[key]) for s in steps]

    losses = [*values(ref["steps"], "loss"), ref["val_loss"]]
    loss_bound = RATIO * _distance(
        [*values(autocast["steps"], "loss"), autocast["val_loss"]], losses
    )
    norms = values(ref["steps"], "norm")
    norm_bound = RATIO * _distance(values(autocast["steps"], "norm"), norms) + FLOOR
    for out in ranks:
        run = out["bf16-mixed"]
        assert len(run["before_backward"]) == len(run["before_step_norms"]) == STEPS
        run_losses = [*values(run["train"], "user_loss"), run["val_loss"]]
        assert _distance(run_losses, losses) <= loss_bound + FLOOR
        # a loss 1% off (the size of a wrong divisor) fails: the bound is far tighter
        assert _distance([v * 1.01 for v in losses], losses) > loss_bound + FLOOR
        assert _distance(run["before_step_norms"], norms) <= norm_bound
        run_update = update(start, run["params"])
        assert relative_distance(run_update, delta_fp32) <= update_bound
        assert relative_distance(1.05 * run_update, delta_fp32) > update_bound
        for step, expected in zip(run["train"], ref["steps"], strict=True):
            assert step["user_loss"] == pytest.approx(step["train_loss"], rel=1e-6)
            assert step["supervised"] == expected["tokens"]
    assert len({tuple(s["user_loss"] for s in out["bf16-mixed"]["train"]) for out in ranks}) == 1


@pytest.mark.multiprocess
def test_bf16_mixed_exchanges_only_16_bit_kv(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["32-true"]["exchanged_dtypes"] == ["torch.float32"]
        assert out["bf16-mixed"]["exchanged_dtypes"] == ["torch.bfloat16"]
        # the same plans and layouts (training and validation) in both runs: half the bytes
        assert out["32-true"]["exchanged_bytes"] > 0
        assert 2 * out["bf16-mixed"]["exchanged_bytes"] == out["32-true"]["exchanged_bytes"]


@pytest.mark.multiprocess
def test_all_gather_inside_a_step_is_refused_not_hung(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        assert out["gather_error"] is not None
        assert "all_gather" in out["gather_error"] and "sync_dist=True" in out["gather_error"]


@pytest.mark.multiprocess
def test_monitored_callbacks_clip_by_value_and_short_epochs(ranks: list[dict[str, Any]]) -> None:
    """``EarlyStopping`` and ``ModelCheckpoint`` on ``val_loss`` decide alike on every rank and
    as on one process; ``gradient_clip_algorithm="value"`` clips the whole averaged gradient once
    per step; ``limit_train_batches`` ends each epoch after its batches and ``val_check_interval``
    validates mid-epoch."""
    ref = monitored_reference()
    losses = ref["val_losses"]
    # after step 1 a first value, after step 2 better (the best), after step 3 worse: stop
    assert losses[0] - losses[1] > DECISION_MARGIN
    assert losses[2] - losses[1] > DECISION_MARGIN
    for step in range(STOP_AFTER):
        assert ref["clipped"][step] > 0 and ref["kept"][step] > 0  # the clip changes the update
    for out in ranks:
        run = out["monitored"]
        # DP rank 0 ran 2 micro-batches per step and DP rank 1 one (asserted for every rank's
        # steps in test_micro_batch_counts_differ_between_dp_ranks)
        assert [(s["max"], s["min"]) for s in run["train"]] == [(2, 1)] * STOP_AFTER
        # a validation after every step, the one after step 2 at the start of the second epoch:
        # the epoch ended after limit_train_batches = 2 of the 3 batches
        assert [step for step, _ in run["val_losses"]] == list(range(1, STOP_AFTER + 1))
        assert run["stopped_epoch"] == 1  # stopped in the second epoch
        # the synced val_loss is the single-process value; the stop came at its first rise
        assert [loss for _, loss in run["val_losses"]] == pytest.approx(
            losses[:STOP_AFTER], rel=VALUE_REL
        )
        assert run["global_step"] == STOP_AFTER
        # the best checkpoint is step 2's (the end of the first epoch), the only one kept
        assert run["best_score"] == pytest.approx(losses[BEST - 1], rel=VALUE_REL)
        assert run["best_path"] == f"epoch=0-step={BEST}.ckpt"
        assert run["checkpoints"] == [run["best_path"]]
        # value clipping of the averaged gradient, batches 0, 1, 0: the single-process update
        assert _max_diff(run["params"], ref["params"]) < PARAM_ATOL
    runs = [[s["run"] for s in out["monitored"]["train"]] for out in ranks]
    assert runs[0] != runs[2]
    for key in ("val_losses", "best_score"):  # the very same value on every rank
        assert len({repr(out["monitored"][key]) for out in ranks}) == 1


def _smoothed(losses: list[float]) -> list[float]:
    """The learning-rate finder's curve of ``losses``: its smoothing, counting steps from
    global_step 1."""
    smoothed, average = [], 0.0
    for step, loss in enumerate(losses, start=1):
        average = LR_FINDER_BETA * average + (1 - LR_FINDER_BETA) * loss
        smoothed.append(average / (1 - LR_FINDER_BETA ** (step + 1)))
    return smoothed


def _sixteen_bit_bounds(
    steps: int,
    batches: tuple[Batch, ...] | None = None,
    frozen: tuple[tuple[str, ...], ...] | None = None,
) -> tuple[dict[str, Any], np.ndarray, float, float]:
    """The 16-bit rule for ``steps`` SGD steps of :data:`LR` of the other habits' data (the
    global batches ``batches``, the parameters ``frozen``, see :func:`habit_reference`): the
    float32 reference, its update, and the bounds of a run's update and logged losses
    (``RATIO`` x single-process bf16 autocast's distance to float32, plus ``FLOOR``)."""
    fp32 = habit_reference((LR,) * steps, batches=batches, frozen=frozen)
    bf16 = habit_reference((LR,) * steps, autocast=True, batches=batches, frozen=frozen)
    delta_fp32 = update(fp32["start"], fp32["params"][-1])
    own = relative_distance(update(bf16["start"], bf16["params"][-1]), delta_fp32)
    loss_bound = RATIO * _distance(bf16["losses"], fp32["losses"]) + FLOOR
    return fp32, delta_fp32, RATIO * own + FLOOR, loss_bound


def _distance(values: Any, reference: Any) -> float:
    """Relative distance of a vector of values (losses, a curve) to the float32 reference's:
    the measure of the 16-bit rule (docs/precision.md) applied to them."""
    a, b = np.asarray(values, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.multiprocess
def test_learning_rate_finder_sees_the_global_loss(ranks: list[dict[str, Any]]) -> None:
    """``Tuner.lr_find``: its curve is the global loss of each step (as on one process), not the
    share of it that rank 0 holds; the weights come back bit for bit and the fit after it trains
    the first global batches again."""
    lrs = ranks[0]["other"]["lr_find"]["lr"]
    ref = habit_reference(tuple(lrs))
    smoothed = _smoothed(ref["losses"])
    # the step-0 shares of the plain run (the same weights and batch): rank 0's is far from the
    # global loss, so a curve of shares would fail below
    share = ranks[0]["32-true"]["before_backward"][0]
    assert abs(share - ref["losses"][0]) > 1e-2 * ref["losses"][0]
    for out in ranks:
        found = out["other"]
        assert found["lr_find"]["lr"] == lrs and len(lrs) == STEPS and lrs[0] != lrs[1]
        assert found["lr_find"]["loss"] == pytest.approx(smoothed, rel=VALUE_REL)
        assert _max_diff(found["lr_find_restored"], found["lr_find_initial"]) == 0.0
        # the fit after it: batches 0 and 1 from the initial weights, at the module's LR
        after = found["after_lr_find"]
        assert [s["user_loss"] for s in after["train"]] == pytest.approx(
            habit_reference((LR,) * STEPS)["losses"], rel=VALUE_REL
        )
        assert _max_diff(after["params"], habit_reference((LR,) * STEPS)["params"][-1]) < PARAM_ATOL


@pytest.mark.multiprocess
def test_learning_rate_finder_in_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """``Tuner.lr_find`` under ``"bf16-mixed"``: the weights come back bit for bit; the curve,
    and the losses and update of the fit after it, are held to the 16-bit rule against plain HF
    in float32, with plain HF under bf16 autocast as d(ref). Measured: the curve 8.1e-6 (d(ref)
    1.1e-5, bound 1.0e-3; rank 0's share in place of the first global loss lands at 1.4e-1);
    the fit after it, update 3.6e-3 (d(ref) 4.1e-3, bound 9.1e-3), losses 8.9e-6 (d(ref)
    7.4e-6, bound 1.0e-3)."""
    lrs = ranks[0]["other_bf16"]["lr_find"]["lr"]
    assert lrs == ranks[0]["other"]["lr_find"]["lr"]  # the finder's schedule, in any precision
    fp32, bf16 = habit_reference(tuple(lrs)), habit_reference(tuple(lrs), autocast=True)
    curve = _smoothed(fp32["losses"])
    curve_bound = RATIO * _distance(_smoothed(bf16["losses"]), curve) + FLOOR
    # a curve of rank 0's shares (its share of step 0 in the plain float32 run, the same
    # weights and batch) fails the bound
    share = ranks[0]["32-true"]["before_backward"][0]
    assert _distance(_smoothed([share, *fp32["losses"][1:]]), curve) > curve_bound
    after_fp32, delta_fp32, update_bound, loss_bound = _sixteen_bit_bounds(STEPS)
    for out in ranks:
        found = out["other_bf16"]
        assert _max_diff(found["lr_find_restored"], found["lr_find_initial"]) == 0.0
        assert _distance(found["lr_find"]["loss"], curve) <= curve_bound
        assert _distance(1.05 * np.asarray(found["lr_find"]["loss"]), curve) > curve_bound
        after = found["after_lr_find"]
        assert [(s["max"], s["min"]) for s in after["train"]] == [(2, 1)] * STEPS
        cell = update(after_fp32["start"], after["params"])
        assert relative_distance(cell, delta_fp32) <= update_bound
        assert relative_distance(1.05 * cell, delta_fp32) > update_bound
        losses = [s["user_loss"] for s in after["train"]]
        assert _distance(losses, after_fp32["losses"]) <= loss_bound
    runs = [[s["run"] for s in out["other_bf16"]["after_lr_find"]["train"]] for out in ranks]
    assert runs[0] != runs[2]


def _assert_resumed(out: dict[str, Any], habit: str, first: int) -> None:
    """The resumed part of ``out[...][habit]`` trained global batches ``first ..`` (DP ranks
    running 2 and 1 micro-batches) and ended where the uninterrupted run ends: in both
    precisions the uninterrupted run of that precision (the ``flags`` run: the same fit, with
    flags that change nothing), to :data:`RESUME_ATOL`; in float32 also plain HF on one
    process."""
    ref = habit_reference((LR,) * HABIT_STEPS)
    # the resumed steps move the weights far more than the tolerance: resuming at the wrong
    # position, or training a step twice, could not pass
    assert _max_diff(ref["params"][-1], ref["params"][first - 1]) > 1e4 * RESUME_ATOL
    for key in ("other", "other_bf16"):
        run, whole = out[key][habit], out[key]["flags"]
        assert [(s["max"], s["min"]) for s in run["resumed"]] == [(2, 1)] * (HABIT_STEPS - first)
        assert [s["user_loss"] for s in run["resumed"]] == pytest.approx(
            [s["user_loss"] for s in whole["train"][first:]], rel=1e-6
        )
        assert _max_diff(run["params"], whole["params"]) < RESUME_ATOL
    run = out["other"][habit]
    assert [s["user_loss"] for s in run["resumed"]] == pytest.approx(
        ref["losses"][first:], rel=VALUE_REL
    )
    assert _max_diff(run["params"], ref["params"][-1]) < PARAM_ATOL


@pytest.mark.multiprocess
def test_max_time_stops_mid_epoch_and_its_checkpoint_resumes(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for key in ("other", "other_bf16"):
            run = out[key]["max_time"]
            assert run["steps"] == TIMER_STOP  # stopped after TIMER_STOP steps, mid-epoch
            assert run["files"] == [f"epoch=0-step={TIMER_STOP}.ckpt"]
        _assert_resumed(out, "max_time", TIMER_STOP)
    for key in ("other", "other_bf16"):
        runs = [[s["run"] for s in out[key]["max_time"]["resumed"]] for out in ranks]
        assert runs[0] != runs[2]


@pytest.mark.multiprocess
def test_max_time_resume_under_fsdp_in_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """``SkrullFSDPStrategy``, ``"bf16-mixed"``: max_time stops mid-epoch, and the run resumed
    from the sharded checkpoint of that step ends bit for bit where the uninterrupted run ends
    (the same micro-batches on the same float32 shards; FSDP2 reduces in a fixed order)."""
    for out in ranks:
        run = out["fsdp_max_time"]
        assert run["steps"] == TIMER_STOP
        assert run["files"] == [f"epoch=0-step={TIMER_STOP}.ckpt"]
        resumed, whole = run["resumed"]["steps"], run["whole"]["steps"]
        assert [(s["max"], s["min"]) for s in resumed] == [(2, 1)] * (HABIT_STEPS - TIMER_STOP)
        assert [s["samples"] for s in resumed] == [s["samples"] for s in whole[TIMER_STOP:]]
    full = ranks[0]["fsdp_max_time"]
    assert _max_diff(full["resumed"]["params"], full["whole"]["params"]) == 0.0
    # the resumed steps moved the weights: a resume that trained nothing could not pass
    assert _max_diff(full["resumed"]["params"], full["stopped_params"]) > 1e-3
    assert all(out["fsdp_max_time"]["whole"]["params"] == {} for out in ranks[1:])
    runs = [[s["run"] for s in out["fsdp_max_time"]["resumed"]["steps"]] for out in ranks]
    assert runs[0] != runs[2]


@pytest.mark.multiprocess
def test_on_exception_checkpoint_resumes_the_run(ranks: list[dict[str, Any]]) -> None:
    for out in ranks:
        for key in ("other", "other_bf16"):
            run = out[key]["exception"]
            assert run["error"] == "raised in training_step"
            assert run["steps"] == RAISE_AT  # steps 0 .. RAISE_AT - 1 completed
            assert run["files"] == ["on_exception.ckpt"]
        # the step that raised is trained again, from the weights before it
        _assert_resumed(out, "exception", RAISE_AT)


def _csv_rows(out: dict[str, Any], key: str) -> list[dict[str, str]]:
    """The rows of rank 0's CSV file that hold the training loss."""
    return [row for row in out[key]["flags"]["csv"] if row.get("train_loss")]


@pytest.mark.multiprocess
def test_anomaly_detection_determinism_profiler_and_csv_logger(
    ranks: list[dict[str, Any]],
) -> None:
    """``detect_anomaly=True``, ``deterministic=True``, ``profiler="simple"`` and overridden
    ``optimizer_step`` / ``optimizer_zero_grad`` (each called once per step) change nothing in
    the training; ``trainer.estimated_stepping_batches`` (read in ``configure_optimizers``, as
    learning-rate schedules do) is the epoch's global batches; the profiler times the strategy's training step once per step; a CSVLogger
    gets the global loss on the steps ``log_every_n_steps`` names."""
    ref = habit_reference((LR,) * HABIT_STEPS)
    for out in ranks:
        for key in ("other", "other_bf16"):
            run = out[key]["flags"]
            assert run["deterministic"]
            assert [(s["max"], s["min"]) for s in run["train"]] == [(2, 1)] * HABIT_STEPS
            assert run["training_steps"] == {"[Strategy]SkrullStrategy.training_step": HABIT_STEPS}
            assert run["overrides"] == dict.fromkeys(run["overrides"], HABIT_STEPS)
            # one epoch of HABIT_STEPS global batches, whatever each rank's share of them
            assert run["estimated_steps"] == HABIT_STEPS
        run = out["other"]["flags"]
        assert [s["user_loss"] for s in run["train"]] == pytest.approx(ref["losses"], rel=VALUE_REL)
        assert _max_diff(run["params"], ref["params"][-1]) < PARAM_ATOL
    logged = list(range(LOG_EVERY - 1, HABIT_STEPS, LOG_EVERY))  # steps 1 and 3
    for key in ("other", "other_bf16"):
        rows = _csv_rows(ranks[0], key)
        assert [int(row["step"]) for row in rows] == logged
        train = ranks[0][key]["flags"]["train"]
        for row, step in zip(rows, logged, strict=True):
            for name in ("train_loss", "user_loss", "dict_loss"):
                assert float(row[name]) == pytest.approx(train[step]["user_loss"], rel=1e-6)
                if key == "other":
                    assert float(row[name]) == pytest.approx(ref["losses"][step], rel=VALUE_REL)


@pytest.mark.multiprocess
def test_flags_csv_logger_and_log_dict_in_bf16_mixed(ranks: list[dict[str, Any]]) -> None:
    """The run with ``detect_anomaly``, ``deterministic``, the simple profiler and a CSVLogger
    (whose rows are the logged values, above), under ``"bf16-mixed"``, against plain HF in
    float32 by the 16-bit rule, plain HF under bf16 autocast as d(ref): the update after
    :data:`HABIT_STEPS` steps (measured 3.7e-3, d(ref) 4.2e-3, bound 9.3e-3) and the synced
    losses ``self.log`` and ``self.log_dict`` logged (1.4e-5, d(ref) 8.3e-6, bound 1.0e-3). The
    token accuracy ``log_dict`` logged flips at most ``RATIO`` times the tokens autocast flips in
    each step, plus one (measured 0 and 0 in every step)."""
    fp32, delta_fp32, update_bound, loss_bound = _sixteen_bit_bounds(HABIT_STEPS)
    bf16 = habit_reference((LR,) * HABIT_STEPS, autocast=True)
    for out in ranks:
        run = out["other_bf16"]["flags"]
        cell = update(fp32["start"], run["params"])
        assert relative_distance(cell, delta_fp32) <= update_bound
        assert relative_distance(1.05 * cell, delta_fp32) > update_bound
        for name in ("user_loss", "dict_loss", "train_loss"):
            losses = [s[name] for s in run["train"]]
            assert _distance(losses, fp32["losses"]) <= loss_bound
            assert _distance(1.05 * np.asarray(losses), fp32["losses"]) > loss_bound
        steps = zip(run["train"], fp32["tokens"], fp32["correct"], bf16["correct"], strict=True)
        for step, tokens, correct, autocast_correct in steps:
            # self.log_dict goes through self.log: the very values of the same rule
            assert step["dict_loss"] == step["user_loss"]
            assert step["dict_acc"] == step["token_acc"]
            assert step["supervised"] == tokens
            flipped = abs(round(step["dict_acc"] * tokens) - correct)
            assert flipped <= RATIO * abs(autocast_correct - correct) + 1
    runs = [[s["run"] for s in out["other_bf16"]["flags"]["train"]] for out in ranks]
    assert runs[0] != runs[2]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("habit", "batches"), [("overfit", (0,) * OVERFIT_EPOCHS), ("fast_dev_run", (0,))]
)
def test_overfit_batches_and_fast_dev_run(
    ranks: list[dict[str, Any]], habit: str, batches: tuple[int, ...]
) -> None:
    """``Trainer(overfit_batches=1)`` on shuffled data trains the first global batch in dataset
    order in every epoch (Lightning turns shuffling off for its own loaders, and failed to
    rebuild Skrull's) and validates on the first validation batch after each epoch;
    ``fast_dev_run=True`` runs one step and one validation batch (on data in dataset order:
    Lightning keeps a shuffle there). In float32 the weights are
    plain HF's on one process to :data:`PARAM_ATOL` and the logged losses to :data:`VALUE_REL`;
    in ``"bf16-mixed"`` the update and the losses by the 16-bit rule (reference: the same
    steps under bf16 autocast on one process)."""
    steps = len(batches)
    fp32, delta_fp32, update_bound, loss_bound = _sixteen_bit_bounds(steps, batches)
    for out in ranks:
        for key in ("other", "other_bf16"):
            run = out[key][habit]
            assert [(s["max"], s["min"]) for s in run["train"]] == [(2, 1)] * steps
            assert [(s["max"], s["min"]) for s in run["val"]] == [(2, 1)] * steps
            # the first global batch in every step (a shuffled one has other tokens)
            assert [s["supervised"] for s in run["train"]] == fp32["tokens"]
        run = out["other"][habit]
        losses = [s["user_loss"] for s in run["train"]]
        assert losses == pytest.approx(fp32["losses"], rel=VALUE_REL)
        assert _max_diff(run["params"], fp32["params"][-1]) < PARAM_ATOL
        run = out["other_bf16"][habit]
        cell = update(fp32["start"], run["params"])
        assert relative_distance(cell, delta_fp32) <= update_bound
        losses = [s["user_loss"] for s in run["train"]]
        assert _distance(losses, fp32["losses"]) <= loss_bound
    for key in ("other", "other_bf16"):
        runs = [[s["run"] for s in out[key][habit]["train"]] for out in ranks]
        assert runs[0] != runs[2]


@pytest.mark.multiprocess
@pytest.mark.parametrize("where", ["training_step", "validation_end", "epoch_end"])
def test_should_stop_on_one_rank_stops_every_rank(ranks: list[dict[str, Any]], where: str) -> None:
    """``trainer.should_stop`` set on one rank only (in ``training_step``, in
    ``on_validation_end``, in ``on_train_epoch_end``; each in the first step) stops every rank
    after that step, as one process stops: before, the rank that stopped left the fit or
    validated alone and the others waited in their collectives until the timeout. Stopping in
    the step still validates once (Lightning validates on a stop), on every rank. The one step
    trained equals plain HF's on one process (float32 to :data:`PARAM_ATOL`; ``"bf16-mixed"``
    by the 16-bit rule)."""
    fp32, delta_fp32, update_bound, _ = _sixteen_bit_bounds(1)
    # the validation set holds 2 global batches (each recorded)
    validated = {"training_step": 2, "validation_end": 2, "epoch_end": 0}[where]
    for out in ranks:
        for key in ("other", "other_bf16"):
            run = out[key][f"stop_{where}"]
            assert run["global_step"] == 1
            assert [(s["max"], s["min"]) for s in run["train"]] == [(2, 1)]
            assert len(run["val"]) == validated
        run = out["other"][f"stop_{where}"]
        assert _max_diff(run["params"], fp32["params"][0]) < PARAM_ATOL
        cell = update(fp32["start"], out["other_bf16"][f"stop_{where}"]["params"])
        assert relative_distance(cell, delta_fp32) <= update_bound
    for key in ("other", "other_bf16"):
        runs = [[s["run"] for s in out[key][f"stop_{where}"]["train"]] for out in ranks]
        assert runs[0] != runs[2]


@pytest.mark.multiprocess
def test_a_batch_skipped_on_one_rank_skips_the_epoch_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    """``on_train_batch_start`` returning ``-1`` (skip the rest of the epoch) on one rank only:
    every rank skips it, as one process would. Before, that rank went on to the next epoch
    while the others trained the batch, and their collectives no longer paired (a gloo error
    once the rank finished; on NCCL, a hang or mismatched collectives). The steps trained
    (epoch 0's first global batch, then epoch 1's two) equal plain HF's on one process (float32
    to :data:`PARAM_ATOL`; ``"bf16-mixed"`` by the 16-bit rule)."""
    steps = len(SKIPPED_BATCHES)
    _trained_as_one_process(ranks, "skip", _sixteen_bit_bounds(steps, SKIPPED_BATCHES))
    for out in ranks:
        for key in ("other", "other_bf16"):
            assert out[key]["skip"]["global_step"] == steps
            # the module's own hook again after the fit
            assert not out[key]["skip"]["hook_left_wrapped"]


def _trained_as_one_process(
    ranks: list[dict[str, Any]], case: str, bounds: tuple[dict[str, Any], np.ndarray, float, float]
) -> None:
    """The other habits' run ``case`` on every rank, in both precisions, against
    :func:`_sixteen_bit_bounds`' reference ``bounds``: the reference's global batches step by
    step, the loss of each step and the weights plain HF's on one process (float32 to
    :data:`VALUE_REL` and :data:`PARAM_ATOL`, ``"bf16-mixed"`` by the 16-bit rule), and the DP
    ranks ran different micro-batch counts."""
    fp32, delta_fp32, update_bound, loss_bound = bounds
    for out in ranks:
        for key in ("other", "other_bf16"):
            assert [s["supervised"] for s in out[key][case]["train"]] == fp32["tokens"]
        run = out["other"][case]
        losses = [s["user_loss"] for s in run["train"]]
        assert losses == pytest.approx(fp32["losses"], rel=VALUE_REL)
        assert _max_diff(run["params"], fp32["params"][-1]) < PARAM_ATOL
        run = out["other_bf16"][case]
        assert relative_distance(update(fp32["start"], run["params"]), delta_fp32) <= update_bound
        assert _distance([s["user_loss"] for s in run["train"]], fp32["losses"]) <= loss_bound
    for key in ("other", "other_bf16"):
        runs = [[s["run"] for s in out[key][case]["train"]] for out in ranks]
        assert runs[0] != runs[2]


def _shuffled_batches(epochs: int, batches: int) -> tuple[tuple[int, ...], ...]:
    """The samples of the first ``batches`` global batches of each epoch of the other habits'
    data shuffled with ``SkrullDataModule``'s default seed 0: docs/data.md's order, a
    permutation per epoch from numpy's generator seeded with ``(seed, epoch)``."""
    size, count = len(LENGTHS), len(LENGTHS) * HABIT_STEPS
    out = []
    for epoch in range(epochs):
        order = np.random.default_rng(np.random.SeedSequence([0, epoch])).permutation(count)
        out += [tuple(int(i) for i in order[k * size : (k + 1) * size]) for k in range(batches)]
    return tuple(out)


@pytest.mark.multiprocess
def test_a_second_fit_on_the_same_trainer_trains_the_next_epoch(
    ranks: list[dict[str, Any]],
) -> None:
    """``trainer.fit`` again after raising ``trainer.fit_loop.max_epochs`` (one epoch more, as
    in a notebook) trains the second epoch's shuffled global batches from the weights the first
    fit left, as one process trains two epochs. Lightning builds the optimizer again for the
    second fit (SGD without momentum here: no state to lose). The weights are plain HF's on one
    process to :data:`PARAM_ATOL` in float32, and by the 16-bit rule in ``"bf16-mixed"``."""
    batches = _shuffled_batches(2, SECOND_FIT_BATCHES)
    first, second = batches[:SECOND_FIT_BATCHES], batches[SECOND_FIT_BATCHES:]
    assert sorted(first) != sorted(second)  # the epochs' global batches differ
    steps = len(batches)
    _trained_as_one_process(ranks, "second_fit", _sixteen_bit_bounds(steps, batches))
    for out in ranks:
        for key in ("other", "other_bf16"):
            assert out[key]["second_fit"]["global_step"] == steps


@pytest.mark.multiprocess
def test_parameters_frozen_and_unfrozen_mid_fit_train_as_on_one_process(
    ranks: list[dict[str, Any]],
) -> None:
    """Lightning's ``BaseFinetuning`` unfreezes the embeddings (into a parameter group of
    their own) and freezes the LM head when epoch 1 starts. DDP reduces the gradients of the
    parameters trainable when it was built, and only those: before ``SkrullStrategy`` wrapped
    the module again at such a change, the unfrozen embeddings stepped with each DP rank's own
    gradient (with only the embeddings unfrozen: 0.039 from one process after 4 steps at DP=2
    x CP=2, the DP ranks' copies 0.057 apart; plain Lightning's DDP does the same), and the
    frozen head left DDP waiting for its gradient (a RuntimeError at the next step that asks
    for ``find_unused_parameters``). Now the weights are plain HF's on one process,
    with the same parameters frozen in each step, to :data:`PARAM_ATOL` in float32 and by the
    16-bit rule in ``"bf16-mixed"``; each rank runs a new wrapper, and the first is gone. The
    same run under ``SkrullFSDPStrategy`` equals the reference too (``bf16-mixed``: by the
    16-bit rule against FSDP2's policy on one process with the same phases). Measured:
    ``SkrullStrategy`` 1.2e-7 in float32, d(cell) 4.1e-3 against a bound of 1.0e-2 in
    ``bf16-mixed``; ``SkrullFSDPStrategy`` 1.2e-7, and d(cell) 5.9e-3 against d(ref) 6.3e-3
    (bound 1.4e-2)."""
    steps = len(PHASED_BATCHES)
    fp32, delta_fp32, update_bound, loss_bound = _sixteen_bit_bounds(
        steps, PHASED_BATCHES, PHASED_FROZEN
    )
    # the phases matter: the embeddings move in the second epoch only, the head in the first
    for name, moves in (("model.embed_tokens.weight", (0, 0, 1, 1)),
                        ("lm_head.weight", (1, 1, 0, 0))):  # fmt: skip
        before = [fp32["start"], *fp32["params"]]
        moved = tuple(
            int(not np.array_equal(a[name], b[name])) for a, b in itertools.pairwise(before)
        )
        assert moved == moves
    _trained_as_one_process(ranks, "phased", (fp32, delta_fp32, update_bound, loss_bound))
    for out in ranks:
        for key in ("other", "other_bf16"):
            assert out[key]["phased"]["rewrapped"] and not out[key]["phased"]["first_alive"]
    # FSDP2 reduce-scatters whatever gradients the backward leaves: the same run under
    # SkrullFSDPStrategy needs nothing more (full weights on rank 0). In bf16-mixed FSDP2's
    # policy is judged against the same policy on one process with the same phases
    fsdp = ranks[0]["fsdp_phased/32-true"]
    assert _max_diff(fsdp["params"], fp32["params"][-1]) < PARAM_ATOL
    size = len(LENGTHS)
    policy_start, policy_end = bf16_policy_training(
        reference_model,
        make_data(HABIT_STEPS, seed=0),
        steps,
        batches=[range(b * size, (b + 1) * size) for b in PHASED_BATCHES],
        frozen=PHASED_FROZEN,
    )
    own = relative_distance(update(policy_start, policy_end), delta_fp32)
    fsdp = ranks[0]["fsdp_phased/bf16-mixed"]
    assert own > FLOOR
    assert (
        relative_distance(update(fp32["start"], fsdp["params"]), delta_fp32) <= RATIO * own + FLOOR
    )
    for precision in ("32-true", "bf16-mixed"):
        runs = [[s["run"] for s in out[f"fsdp_phased/{precision}"]["train"]] for out in ranks]
        assert runs[0] != runs[2]


# ----------------------------------------------------------------------------- one process
def test_metric_synced_on_step_is_refused_at_setup(world_of_one: None) -> None:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    module = HabitsLM()
    module.step_acc = torchmetrics.classification.MulticlassAccuracy(
        num_classes=VOCAB, dist_sync_on_step=True
    )
    trainer = cpu_trainer(SkrullStrategy(bucket_size=64, chunked_loss=False), max_steps=1)
    data = SkrullDataModule(train_data=make_data(1, seed=0), global_batch_size=len(LENGTHS))
    with pytest.raises(ValueError, match=r"'step_acc'.*dist_sync_on_step=True"):
        trainer.fit(module, data)


def test_barebones_trainer_runs_without_logging(world_of_one: None) -> None:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    module = PlainLM()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SkrullStrategy(bucket_size=64),
        max_steps=1,
        barebones=True,
    )
    data = SkrullDataModule(
        train_data=make_data(1, seed=0), global_batch_size=len(LENGTHS), shuffle=False
    )
    trainer.fit(module, data)
    assert trainer.global_step == 1
    assert math.isfinite(float(next(module.parameters()).sum()))


def test_batch_flops_and_throughput_figures_on_every_rank() -> None:
    from lightning_skrull.data.batch import RankPlanner, SkrullBatch
    from lightning_skrull.scheduling.cost_model import CostModel

    model = reference_model()
    samples = make_data(1, seed=0)
    reference = sum(reference_forward_flops(model, n) for n in LENGTHS)
    cost_model = CostModel.from_hf_config(model.config)
    batches = [
        RankPlanner(
            dp_size=2, cp_size=CP, dp_rank=dp, cp_rank=cp, bucket_size=BUCKET,
            policy="skrull", cost_model=cost_model,
        )(samples, list(range(len(samples))), 0, 0)
        for dp in range(2)
        for cp in range(CP)
    ]  # fmt: skip
    assert len({len(b.rank_batch.micro_batches) for b in batches}) == 2  # 2 and 1
    for batch in batches:  # the same figures on every rank, whatever share it holds
        assert batch.sequences_per_device == len(LENGTHS) / 4
        assert batch.tokens_per_device == sum(LENGTHS) / 4
        assert batch.flops_per_device(backward=False) == pytest.approx(reference / 4, rel=1e-12)
        assert batch.flops_per_device() == pytest.approx(3 * reference / 4, rel=1e-12)
    with pytest.raises(TypeError, match=r"batch\['input_ids'\]\).*batch_size_fn=lambda b"):
        batches[0]["input_ids"]
    bare = SkrullBatch(batches[0].rank_batch, batches[0].stats, 0, 0)
    with pytest.raises(ValueError, match="no cost model or no sequence lengths"):
        bare.flops_per_device()


def test_batch_size_finder_is_refused_before_any_step(world_of_one: None, tmp_path: Any) -> None:
    """The batch of a step is ``SkrullDataModule(global_batch_size=...)``, not a loader's batch
    size: Lightning refuses its batch-size finder, as a Tuner call and as a callback, under any
    data-parallel strategy, before a step runs."""
    from lightning.pytorch.callbacks import BatchSizeFinder
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_skrull import SkrullDataModule, SkrullFSDPStrategy, SkrullStrategy

    def data() -> SkrullDataModule:
        return SkrullDataModule(train_data=make_data(1, seed=0), global_batch_size=len(LENGTHS))

    module = PlainLM()
    trainer = cpu_trainer(SkrullStrategy(bucket_size=64), max_steps=1)
    with pytest.raises(ValueError, match="batch size is currently not supported with distributed"):
        Tuner(trainer).scale_batch_size(module, datamodule=data())
    trainer = cpu_trainer(
        SkrullStrategy(bucket_size=64), max_steps=1, callbacks=[BatchSizeFinder()]
    )
    with pytest.raises(MisconfigurationException, match="not supported with distributed"):
        trainer.fit(module, data())
    assert trainer.global_step == 0
    # a folder that is not a Skrull FSDP checkpoint is refused by name
    with pytest.raises(ValueError, match=r"no meta\.pt.*save_distributed_checkpoint=True"):
        SkrullFSDPStrategy.consolidate_checkpoint(tmp_path, tmp_path / "full.ckpt")


COLLECTIVES = {
    "strategy.reduce": lambda strategy, x: strategy.reduce(x, reduce_op="sum"),
    "strategy.broadcast": lambda strategy, x: strategy.broadcast(x),
    "strategy.barrier": lambda strategy, x: strategy.barrier(),
    "all_gather (self.all_gather)": lambda strategy, x: strategy.all_gather(x),
}
"""The collectives a step could call through the strategy, by the name the refusal gives.
In a step each would be called once per micro-batch, a different number of times on each DP
rank, and hang; the multi-process spawn above shows ``self.all_gather``'s refusal on every
rank, this one process the rule for each of them."""


class CollectiveLM(PlainLM):
    """:class:`PlainLM` that calls one collective in ``training_step`` (``in_step``) or in
    ``on_train_batch_end`` and ``on_train_epoch_end``, where it is allowed."""

    def __init__(self, collective: str, in_step: bool) -> None:
        super().__init__()
        self.collective, self.in_step = collective, in_step
        self.results: list[Any] = []

    def _call(self) -> None:
        self.results.append(COLLECTIVES[self.collective](self.trainer.strategy, torch.ones(2)))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if self.in_step:
            self._call()
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.in_step:
            self._call()

    def on_train_epoch_end(self) -> None:
        if not self.in_step:
            self._call()


@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_collectives_are_refused_inside_a_step_and_allowed_in_other_hooks(
    world_of_one: None, collective: str
) -> None:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    def fit(module: CollectiveLM) -> None:
        trainer = cpu_trainer(SkrullStrategy(bucket_size=64), max_steps=2)
        data = SkrullDataModule(train_data=make_data(8, seed=0), global_batch_size=4)
        trainer.fit(module, data)

    with pytest.raises(RuntimeError) as caught:
        fit(CollectiveLM(collective, in_step=True))
    message = str(caught.value)
    assert message.startswith(f"{collective} was called while SkrullStrategy runs a step's")
    assert "self.log(..., sync_dist=True)" in message and "on_train_batch_end" in message
    allowed = CollectiveLM(collective, in_step=False)
    fit(allowed)
    assert len(allowed.results) == 3  # after each of the 2 steps, and at the epoch's end
