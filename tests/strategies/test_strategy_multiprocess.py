"""Trainer.fit with the Skrull strategies on several gloo processes equals plain HF training.

Two spawns (each process start costs seconds, so every case of a world size runs in one):

- 4 processes, DP=2 x CP=2: DDP and ZeRO-2 parity with single-process training, exact
  validation loss and perplexity (of one set, and of named short and long sets, validation
  and test; ZeRO-2: validation of one set and of the named sets), bf16-mixed (with gradient
  clipping too, by the rule of tests/strategies/test_precision_matrix.py), and resume mid-epoch and at an
  epoch boundary (final parameters equal an uninterrupted run; every sample trained exactly
  once per epoch; DDP and ZeRO-2 also in bf16-mixed, ZeRO-2's masters and bf16 copies
  alike). ZeRO-2 clipping by norm with the DP ranks planned different micro-batch counts, in
  float32 and bf16-mixed. ZeRO stage 1 (through the DeepSpeed config), in float32 and
  bf16-mixed. What a LightningModule's hooks change, on global batches that give the DP ranks 2
  and 1 micro-batches in every step: a ``backward`` override (once per micro-batch, scaling
  the loss) and ``configure_gradient_clipping`` clipping by value, each in float32 and in
  bf16-mixed (by the rule of tests/strategies/test_precision_matrix.py), a ``LambdaLR`` warm-up stepped
  per global batch. The DDP, ZeRO-2 and bf16-mixed ZeRO-2 runs write their model
  with ``trainer.strategy.save_pretrained``, read back on one process by plain transformers: the
  trained weights (ZeRO-2's float32 masters) and the validation loss the runs logged.
  Sliding-window models: a Mistral with a 12-token window on every layer, a Qwen2 whose
  second layer slides over 9 tokens (``layer_types`` full, sliding), a Gemma 3 text model
  (sliding over 7 tokens, full, sliding; RoPE per layer kind, q/k norms), a Phi-3 (12 tokens),
  an EXAONE 4 and an OLMo 3 (a sliding layer over 9 tokens, then a full one; EXAONE's without
  RoPE) and a SmolLM3 (9 tokens; a RoPE layer, then a NoPE layer), trained on sequences of up
  to 69 tokens (windows cut inside and across the zigzag chunks), equal single-process HF
  training in float32, and all but the Qwen2 in bf16-mixed by the rule of
  tests/strategies/test_precision_matrix.py.
- 3 processes, CP=3: DDP and ZeRO-2 parity with gradient clipping, in float32 and in
  bf16-mixed (by the rule of tests/strategies/test_precision_matrix.py).

The reference is independent of the package: a plain Hugging Face model with eager attention,
one sequence at a time, summed token cross-entropy divided by the global batch's supervised
tokens, then ``torch.optim.SGD``.
"""

from __future__ import annotations

import functools
import json
import math
import os
import tempfile
import time
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    LOSS_SCALE,
    LR,
    PARAM_ATOL,
    TINY_QWEN2,
    WARMUP,
    BatchRecorder,
    PlainLM,
    ScaledBackwardLM,
    StartRecorder,
    WarmupLM,
    bf16_policy_training,
    check_warmup_cells,
    cpu_trainer,
    float32_arrays,
    hooked_reference_training,
    make_data,
    max_diff,
    mean_token_loss,
    reference_loss,
    reference_model,
    reference_training,
    sgd_training,
    skrull_strategy,
    tiny_model,
)
from precision_rule import FLOOR, RATIO, relative_distance, update

from lightning_skrull.causal_lm import SkrullCausalLM
from lightning_skrull.runtime.launch import spawn

CLIP = 0.05  # below the gradient norm of these steps, so clipping changes the update
# bf16 autocast rounds every matmul to 8 mantissa bits; the loss of a 64-token vocabulary
# (about 4.2) is then off by up to a few 1e-2 from float32.
BF16_LOSS_ATOL = 5e-2
# A bf16-mixed DDP run resumed mid-epoch against the uninterrupted one. Float32 weights,
# gradients and momentum and the same micro-batches, but not bit for bit: DDP rebuilds its
# gradient buckets after the first step of each run (in the order the gradients became ready),
# so the resumed run's buckets from its step 3 differ from the uninterrupted run's from step 1,
# and gloo's ring all-reduce over the 4 ranks sums each element in another order. With the
# rebuild off (``find_unused_parameters=True`` keeps the first buckets) the two runs were
# measured bitwise equal; with it, 7.5e-9 apart (1.2e-7 in float32), within float32 rounding of
# that sum, which the bf16 forward did not amplify. The resumed steps move the parameters by up
# to 7.0e-2, so an update 5% off lands 3.5e-3 away.
RESUME_BF16_ATOL = 1e-6


# The LightningModule hooks' runs (a backward override, configure_gradient_clipping, a warm-up
# LR scheduler): HOOK_STEPS global batches of HOOK_BATCH samples of make_data(..., HOOK_SEED),
# which the plan (calibration off, so every step plans alike) splits into 2 micro-batches on one
# DP rank and 1 on the other in every step (asserted): one rank runs an earlier micro-batch's
# backward in the strategy, the other only Lightning's last one.
HOOK_STEPS, HOOK_BATCH, HOOK_SEED = 3, 4, 27
HOOK_DATA = make_data(HOOK_STEPS * HOOK_BATCH, seed=HOOK_SEED)
# configure_gradient_clipping clips by this value: between the smallest and the largest gradient
# entry of every step (asserted), so the clip changes some entries and leaves others
CLIP_VALUE = 1e-3

# ZeRO stage 1 is chosen through the DeepSpeed config (the stage argument names this fix);
# torch's SGD, as in the reference
ZERO1_CONFIG = {"zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}

VAL_DATA = make_data(11, seed=1)
SAVED = ("ddp", "zero2", "zero2_bf16")
"""The runs whose trained model ``trainer.strategy.save_pretrained`` writes."""
# save_pretrained of a bf16-mixed ZeRO-2 run writes the float32 masters; their validation loss
# on one process in float32 against the run's logged one, computed on the bf16 model copies:
# bf16 rounding of the weights and of every matmul (BF16_LOSS_ATOL above covers it; measured
# 7.3e-6: 4.159299 against 4.159307). The masters are up to 1.9e-3 from the bf16 copies.

# Two validation sets whose global batches of VAL_BATCH give the DP ranks different micro-batch
# counts in some step of each (asserted below): short samples of 3..40 tokens, and samples of up
# to 80 tokens (cp_size * BUCKET, the longest a sequence may be).
VAL_BATCH = 6
SHORT = make_data(12, seed=4, longest=40)
LONG = make_data(8, seed=102, longest=80)
# The per-set losses must differ by far more than the 1e-5 tolerance for the test to tell the
# sets apart (measured: 6.1e-3 relative under the trained weights: 4.1636 and 4.1888).
SETS_APART = 1e-3


class SetRecordingLM(SkrullCausalLM):
    """The CLI's module, recording the ``dataloader_idx`` of every step call and, per batch,
    what the loader gave this rank."""

    def __init__(self) -> None:
        super().__init__(model={"model_type": "qwen2", **TINY_QWEN2})
        self.calls: list[int] = []
        self.batches: list[dict[str, Any]] = []

    def validation_step(
        self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0
    ) -> Any:
        self.calls.append(dataloader_idx)
        return super().validation_step(batch, batch_idx, dataloader_idx)

    def test_step(self, batch: dict[str, Any], batch_idx: int, dataloader_idx: int = 0) -> Any:
        self.calls.append(dataloader_idx)
        return self.model(**batch).loss

    def _record(self, stage: str, batch: Any, dataloader_idx: int) -> None:
        rb = batch.rank_batch
        self.batches.append(
            {
                "stage": stage,
                "dataloader_idx": dataloader_idx,
                "name": batch.dataset_name,
                "cp_rank": rb.cp_rank,
                "samples": [i for mb in rb.micro_batches for i in mb.sample_indices],
                "calls": self.calls,  # this batch's step calls: one per micro-batch
                "run": len(rb.micro_batches),
                "max": batch.stats.max_micro_batches,
                "min": batch.stats.min_micro_batches,
            }
        )
        self.calls = []

    def on_validation_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._record("validation", batch, dataloader_idx)

    def on_test_batch_end(
        self, outputs: Any, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._record("test", batch, dataloader_idx)


class ValueClippingLM(PlainLM):
    """``configure_gradient_clipping`` clipping every gradient entry to :data:`CLIP_VALUE`
    (the Trainer has no ``gradient_clip_val``), counting its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.clip_calls = 0

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        self.clip_calls += 1
        self.clip_gradients(
            optimizer, gradient_clip_val=CLIP_VALUE, gradient_clip_algorithm="value"
        )


def _hook_fit(
    module: PlainLM, strategy: str = "ddp", **trainer_kwargs: Any
) -> tuple[L.Trainer, BatchRecorder]:
    """Fit ``module`` for :data:`HOOK_STEPS` steps on :data:`HOOK_DATA` at DP=2 x CP=2 under
    :func:`~helpers.skrull_strategy` ``strategy``."""
    from lightning_skrull import SkrullDataModule

    recorder = BatchRecorder()
    trainer = cpu_trainer(
        skrull_strategy(strategy, cp_size=2, bucket_size=BUCKET, calibration="off"),
        max_steps=HOOK_STEPS,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    data = SkrullDataModule(train_data=HOOK_DATA, global_batch_size=HOOK_BATCH, shuffle=False)
    trainer.fit(module, data)
    return trainer, recorder


def _params(module: L.LightningModule) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy().copy() for k, v in module.model.state_dict().items()}


def _masters(module: L.LightningModule) -> dict[str, np.ndarray]:
    """DeepSpeed's float32 master copy of every parameter, gathered from the optimizer
    partitions (a collective), by state-dict key."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for name, param in module.model.named_parameters():
        master = safe_get_full_fp32_param(param)
        assert master is not None and master.dtype == torch.float32, name
        out[name] = master.detach().numpy().copy()
    return out


def _saved(directory: str, samples: list[dict[str, list[int]]]) -> dict[str, Any]:
    """A checkpoint written by ``save_pretrained``, read on this one process by plain
    transformers (its default attention, no lightning_skrull): its parameters as stored, its
    config and its validation loss on ``samples``, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype="auto")
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    return {
        "params": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
        "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "class": type(model).__name__,
        "attention": model.config._attn_implementation,
        "config": config,
        "val_loss": mean_token_loss(model, VAL_DATA),
    }


def _fit(
    strategy: Any, steps: int, *, validate: bool = False, **trainer_kwargs: Any
) -> tuple[PlainLM, L.Trainer, BatchRecorder]:
    """Fit :class:`PlainLM`; ``validate``: on :data:`VAL_DATA` at the end of the epoch too
    (after the last of 3 steps), logging ``val_loss`` of the trained weights."""
    from lightning_skrull import SkrullDataModule

    recorder = BatchRecorder()
    trainer = cpu_trainer(strategy, max_steps=steps, callbacks=[recorder], **trainer_kwargs)
    model = PlainLM()
    data = SkrullDataModule(
        train_data=make_data(),
        val_data=VAL_DATA if validate else None,
        global_batch_size=GLOBAL_BATCH,
        val_global_batch_size=4,
        shuffle=False,
    )
    trainer.fit(model, data)
    return model, trainer, recorder


# Sliding-window models (name -> tiny_model arguments): windows of 12 and 9 tokens against
# sequences of 3..69 tokens, whose zigzag chunks at CP=2 hold about a quarter of a sharded one.
WINDOWED: dict[str, dict[str, Any]] = {
    "mistral": {"arch": "mistral", "sliding_window": 12},
    "qwen2": {
        "arch": "qwen2",
        "use_sliding_window": True,
        "sliding_window": 9,
        "max_window_layers": 1,
    },
    # Gemma 3 text: sliding (7 keys, RoPE base 1e4), full (1e6), sliding layers; q/k norms
    # and the final logits soft-capped to 0.1 (within the tiny model's logit range of about
    # +-0.4: it moves the loss by 3e-2), which the chunked loss applies per chunk
    "gemma3": {"arch": "gemma3_text", "sliding_window": 7, "final_logit_softcapping": 0.1},
    # Phi-3: the window on every layer, fused qkv / gate_up, half of each head rotated
    "phi3": {"arch": "phi3", "sliding_window": 12},
    # EXAONE 4: a sliding RoPE layer, then a full layer without RoPE (NoPE); q/k norms per head
    "exaone4": {"arch": "exaone4", "sliding_window": 9},
    # OLMo 3: a sliding layer then a full one; q/k norms over all heads together
    "olmo3": {"arch": "olmo3", "sliding_window": 9},
    # SmolLM3: a RoPE layer then a NoPE layer, the window on both
    "smollm3": {"arch": "smollm3", "sliding_window": 9},
}
WINDOWED_CASES = (
    ("mistral", "32-true"),
    ("qwen2", "32-true"),
    ("gemma3", "32-true"),
    ("phi3", "32-true"),
    ("exaone4", "32-true"),
    ("olmo3", "32-true"),
    ("smollm3", "32-true"),
    ("mistral", "bf16-mixed"),
    ("gemma3", "bf16-mixed"),
    ("phi3", "bf16-mixed"),
    ("exaone4", "bf16-mixed"),
    ("olmo3", "bf16-mixed"),
    ("smollm3", "bf16-mixed"),
)
WINDOWED_STEPS = 2


class WindowedLM(L.LightningModule):
    """The documentation's plain module over a tiny sliding-window model (eager attention
    until the strategy switches it to the Skrull attention)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model = tiny_model(**WINDOWED[name])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _windowed_fit(name: str, precision: str) -> dict[str, Any]:
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    recorder = BatchRecorder()
    trainer = cpu_trainer(
        SkrullStrategy(cp_size=2, bucket_size=BUCKET),
        max_steps=WINDOWED_STEPS,
        callbacks=[recorder],
        precision=precision,
    )
    module = WindowedLM(name)
    before = _params(module)
    data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH, shuffle=False)
    trainer.fit(module, data)
    return {"before": before, "after": _params(module), "steps": recorder.steps}


def windowed_reference(
    name: str, autocast: bool = False, window: bool = True
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(before, after)`` of plain HF training of a :data:`WINDOWED` model: eager attention
    (which applies the window through transformers' own mask), one process, one sequence at a
    time, :data:`WINDOWED_STEPS` SGD steps on :func:`make_data`'s global batches; the forward
    under ``torch.autocast("cpu", bfloat16)`` with ``autocast``; ``window=False``: the same
    model with a window longer than every sequence, so full attention (to show the window
    changes the result)."""
    kwargs = dict(WINDOWED[name])
    if not window:
        kwargs["sliding_window"] = 4096
    model = tiny_model(**kwargs)
    before = {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}
    sgd_training(model, make_data(), WINDOWED_STEPS, autocast=autocast)
    return before, {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


def _resume_dir(zero2: bool, precision: str) -> str:
    """Where a resume case's checkpoints go, under the spawn's checkpoint directory."""
    name = "zero2" if zero2 else ""
    if precision != "32-true":
        name = f"{name or 'ddp'}_{precision}"
    return name


@functools.cache
def clipped_reference(
    autocast: bool,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[float]]:
    """``(before, after, gradient norms)`` of plain HF training of :class:`PlainLM`'s model:
    eager attention, one process, one sequence at a time, 3 SGD steps on :func:`make_data`'s
    global batches, the gradient's norm clipped to :data:`CLIP` before each step; the forward
    under ``torch.autocast("cpu", bfloat16)`` with ``autocast`` (float32 gradients and SGD).
    The norms are each step's before clipping."""
    model = reference_model()
    before = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    norms = sgd_training(model, make_data(), 3, autocast=autocast, clip=CLIP)
    after = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return before, after, norms


def _bf16_start() -> torch.nn.Module:
    """:func:`~helpers.reference_model` with its parameters rounded to bf16 (float32 tensors):
    where DeepSpeed's bf16 masters start."""
    model = reference_model()
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).float()
    return model


@functools.cache
def zero2_reference() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """:func:`zero2_clipped_reference` without the clipping: ``(before, after)`` of the float32
    masters of 3 steps as DeepSpeed's bf16 trains (ZeRO stage 1 or 2)."""
    return bf16_policy_training(_bf16_start, make_data(), 3)


@functools.cache
def zero2_clipped_reference() -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], list[float]]:
    """:func:`clipped_reference` as bf16-mixed ZeRO-2 trains (docs/precision.md): the
    parameters cast to bf16 (buffers float32), bf16 forward and backward, the gradient upcast
    and its norm clipped to :data:`CLIP`, SGD on a float32 master copy made from the bf16
    parameters, copied back to them. ``(before, after)`` are the float32 masters (``before``:
    the initial parameters rounded to bf16)."""
    norms: list[float] = []
    before, after = bf16_policy_training(_bf16_start, make_data(), 3, clip=CLIP, norms=norms)
    return before, after, norms


# ----------------------------------------------------------------------------- 4 ranks
def _four_rank_cases(rank: int, world_size: int, ckpt_dir: str) -> dict[str, Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_skrull import SkrullDataModule, SkrullStrategy, SkrullZero2Strategy
    from lightning_skrull.causal_lm import SkrullCausalLM

    out: dict[str, Any] = {}
    # DDP parity, and the exact loss the strategy logs
    model, trainer, recorder = _fit(SkrullStrategy(cp_size=2, bucket_size=BUCKET), 3)
    out["ddp"] = _params(model)
    out["ddp_loss"] = float(trainer.callback_metrics["train_loss"])
    out["ddp_steps"] = recorder.steps
    trainer.strategy.save_pretrained(os.path.join(ckpt_dir, "pretrained", "ddp"))

    # validation of the trained weights: loss logged by the strategy and torchmetrics perplexity
    evaluator = SkrullCausalLM(model={"model_type": "qwen2", **TINY_QWEN2})
    evaluator.model.load_state_dict(model.model.state_dict())
    val = SkrullDataModule(
        train_data=make_data(), val_data=make_data(11, seed=1), val_global_batch_size=4
    )
    metrics = cpu_trainer(SkrullStrategy(cp_size=2, bucket_size=BUCKET)).validate(evaluator, val)[0]
    out["val_loss"], out["val_ppl"] = metrics["val_loss"], metrics["val_ppl"]

    # named short and long sets: one loader each, validation in mapping order, test reversed
    recorder = SetRecordingLM()
    recorder.model.load_state_dict(model.model.state_dict())
    sets = SkrullDataModule(
        val_data={"short": SHORT, "long": LONG},
        test_data={"long": LONG, "short": SHORT},
        val_global_batch_size=VAL_BATCH,
    )
    trainer = cpu_trainer(SkrullStrategy(cp_size=2, bucket_size=BUCKET))
    out["sets_val"] = trainer.validate(recorder, sets)
    out["sets_test"] = trainer.test(recorder, sets)
    out["sets_batches"] = recorder.batches

    # ZeRO-2 parity (every DP rank padded to the same micro-batch count)
    model, trainer, recorder = _fit(
        SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET), 3, validate=True
    )
    out["zero2"] = _params(model)
    out["zero2_runs"] = [s["run"] for s in recorder.steps]
    out["zero2_trained_val_loss"] = float(trainer.callback_metrics["val_loss"])
    trainer.strategy.save_pretrained(os.path.join(ckpt_dir, "pretrained", "zero2"))

    # bf16-mixed ZeRO-2: the model holds bf16 copies, the optimizer the float32 masters
    model, trainer, recorder = _fit(
        SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET), 3, validate=True, precision="bf16-mixed"
    )
    out["zero2_bf16_master"] = _masters(model)
    out["zero2_bf16_copy"] = _params(model)
    out["zero2_bf16_dtypes"] = sorted({str(p.dtype) for p in model.model.parameters()})
    out["zero2_bf16_steps"] = recorder.steps
    out["zero2_bf16_val_loss"] = float(trainer.callback_metrics["val_loss"])
    trainer.strategy.save_pretrained(os.path.join(ckpt_dir, "pretrained", "zero2_bf16"))
    # a standalone validate on ZeRO-2 (DeepSpeed's inference engine) gives the same loss
    zero2_val = cpu_trainer(SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET))
    out["zero2_val_loss"] = zero2_val.validate(evaluator, val)[0]["val_loss"]
    # and the named sets: one val_loss/<name> per set
    zero2_sets = SetRecordingLM()
    zero2_sets.model.load_state_dict(evaluator.model.state_dict())
    out["zero2_sets_val"] = zero2_val.validate(zero2_sets, sets, verbose=False)
    out["zero2_sets_batches"] = zero2_sets.batches

    # bf16-mixed: the autocast context covers every micro-batch
    model, trainer, _ = _fit(
        SkrullStrategy(cp_size=2, bucket_size=BUCKET), 1, precision="bf16-mixed"
    )
    out["bf16_loss"] = float(trainer.callback_metrics["train_loss"])
    # and with gradient clipping: Lightning clips the step's all-reduced float32 gradients
    model, _, recorder = _fit(
        SkrullStrategy(cp_size=2, bucket_size=BUCKET),
        3,
        gradient_clip_val=CLIP,
        precision="bf16-mixed",
    )
    out["bf16_clipped"], out["bf16_clipped_steps"] = _params(model), recorder.steps

    # ZeRO-2 clipping by norm (DeepSpeed's gradient_clipping) with the DP ranks' micro-batch
    # counts planned apart and padded, in float32 and bf16-mixed (its float32 masters)
    started = time.perf_counter()
    model, _, recorder = _fit(
        SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET), 3, gradient_clip_val=CLIP
    )
    out["zero2_clipped"], out["zero2_clipped_steps"] = _params(model), recorder.steps
    model, _, recorder = _fit(
        SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET),
        3,
        gradient_clip_val=CLIP,
        precision="bf16-mixed",
    )
    out["zero2_bf16_clipped"] = _masters(model)
    out["zero2_bf16_clipped_steps"] = recorder.steps
    out["zero2_clipped_seconds"] = time.perf_counter() - started

    # ZeRO stage 1 (through the DeepSpeed config) with CP=2, in float32 and bf16-mixed (its
    # float32 masters), the DP ranks planned different micro-batch counts and padded
    started = time.perf_counter()
    for precision, name in (("32-true", "zero1"), ("bf16-mixed", "zero1_bf16")):
        model, trainer, recorder = _fit(
            SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET, config=ZERO1_CONFIG),
            3,
            precision=precision,
        )
        out[name] = {
            "params": _params(model) if precision == "32-true" else _masters(model),
            "steps": recorder.steps,
            "stage": trainer.strategy.config["zero_optimization"]["stage"],
            "optimizer": type(trainer.strategy.optimizers[0]).__name__,
        }
    out["zero1_seconds"] = time.perf_counter() - started

    # LightningModule hooks: a backward override, configure_gradient_clipping, an LR scheduler
    # (the backward override and the clipping in float32 and in bf16-mixed)
    started = time.perf_counter()
    for precision, suffix in (("32-true", ""), ("bf16-mixed", "_bf16")):
        scaled = ScaledBackwardLM()
        _, recorder = _hook_fit(scaled, precision=precision)
        out[f"scaled{suffix}"] = {
            "params": _params(scaled),
            "calls": scaled.calls_per_step,
            "steps": recorder.steps,
        }
        clipping = ValueClippingLM()
        _, recorder = _hook_fit(clipping, precision=precision)
        out[f"value_clipped{suffix}"] = {
            "params": _params(clipping),
            "calls": clipping.clip_calls,
            "steps": recorder.steps,
        }
    for strategy in ("ddp", "zero2"):  # the CLI's warm-up, on the strategies its recipes use
        warm = WarmupLM()
        trainer, recorder = _hook_fit(warm, strategy)
        scheduler = trainer.lr_scheduler_configs[0].scheduler
        out[f"warmup_{strategy}"] = {
            "params": _params(warm),
            "lrs": warm.lrs,
            "last_epoch": scheduler.last_epoch,  # type: ignore[union-attr]
            "global_step": trainer.global_step,
            "steps": recorder.steps,
        }
    out["hook_seconds"] = time.perf_counter() - started

    # resume: 6 steps = 2 epochs of 3 global batches, shuffled, SGD with momentum
    def resume_run(
        steps: int,
        ckpt_path: str | None,
        save: bool,
        zero2: bool = False,
        precision: str = "32-true",
    ) -> tuple[PlainLM, StartRecorder]:
        recorder = StartRecorder()  # a resumed run starts from its checkpoint's parameters
        callbacks: list[Any] = [recorder]
        if save:
            callbacks.append(
                ModelCheckpoint(
                    dirpath=os.path.join(ckpt_dir, _resume_dir(zero2, precision)),
                    filename="{step}",
                    every_n_train_steps=1,
                    save_top_k=-1,
                )
            )
        strategy_class = SkrullZero2Strategy if zero2 else SkrullStrategy
        # the model pinned: online calibration refits from measured times, so a resumed run
        # plans like the uninterrupted one only up to the refits after its checkpoint
        trainer = cpu_trainer(
            strategy_class(cp_size=2, bucket_size=BUCKET, calibration="off"),
            max_steps=steps,
            callbacks=callbacks,
            enable_checkpointing=save,
            precision=precision,
        )
        model = PlainLM(momentum=0.9)
        # seed 6: the DP ranks run 3 and 2, then 2 and 3 micro-batches in steps 2 and 3, the
        # first steps after the checkpoints
        data = SkrullDataModule(train_data=make_data(), global_batch_size=GLOBAL_BATCH, seed=6)
        trainer.fit(model, data, ckpt_path=ckpt_path)
        return model, recorder

    whole, whole_rec = resume_run(6, None, save=True)
    resumed_2, rec_2 = resume_run(6, os.path.join(ckpt_dir, "step=2.ckpt"), save=False)
    resumed_3, rec_3 = resume_run(6, os.path.join(ckpt_dir, "step=3.ckpt"), save=False)
    out["whole"], out["whole_steps"] = _params(whole), whole_rec.steps
    out["resumed_2"], out["resumed_2_steps"] = _params(resumed_2), rec_2.steps
    out["resumed_3"], out["resumed_3_steps"] = _params(resumed_3), rec_3.steps

    # the same on ZeRO-2: DeepSpeed writes a checkpoint directory (each rank its optimizer
    # partition); 4 steps straight against a run resumed from step 2, in the middle of epoch 0,
    # so the loader's position and the momentum both have to come back
    whole, whole_rec = resume_run(4, None, save=True, zero2=True)
    resumed, rec = resume_run(
        4, os.path.join(ckpt_dir, "zero2", "step=2.ckpt"), save=False, zero2=True
    )
    out["zero2_whole"], out["zero2_whole_steps"] = _params(whole), whole_rec.steps
    out["zero2_resumed"], out["zero2_resumed_steps"] = _params(resumed), rec.steps

    # and in bf16-mixed: the bf16 model copies and the float32 masters both have to come back
    whole, whole_rec = resume_run(4, None, save=True, zero2=True, precision="bf16-mixed")
    out["zero2_bf16_whole"] = _params(whole)
    out["zero2_bf16_whole_master"] = _masters(whole)
    out["zero2_bf16_whole_steps"] = whole_rec.steps
    resumed, rec = resume_run(
        4,
        os.path.join(ckpt_dir, _resume_dir(True, "bf16-mixed"), "step=2.ckpt"),
        save=False,
        zero2=True,
        precision="bf16-mixed",
    )
    out["zero2_bf16_resumed"] = _params(resumed)
    out["zero2_bf16_resumed_master"] = _masters(resumed)
    out["zero2_bf16_resumed_steps"] = rec.steps

    # and DDP in bf16-mixed: 4 steps straight against a run resumed from step 2 (mid-epoch)
    started = time.perf_counter()
    whole, whole_rec = resume_run(4, None, save=True, precision="bf16-mixed")
    out["bf16_whole"], out["bf16_whole_steps"] = _params(whole), whole_rec.steps
    resumed, rec = resume_run(
        4,
        os.path.join(ckpt_dir, _resume_dir(False, "bf16-mixed"), "step=2.ckpt"),
        save=False,
        precision="bf16-mixed",
    )
    out["bf16_resumed"], out["bf16_resumed_steps"] = _params(resumed), rec.steps
    out["bf16_resumed_start"] = rec.before
    out["bf16_resume_seconds"] = time.perf_counter() - started

    # sliding-window models
    for case in WINDOWED_CASES:
        out[("windowed", *case)] = _windowed_fit(*case)
    return out


# ----------------------------------------------------------------------------- 3 ranks
def _three_rank_cases(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_skrull import SkrullStrategy, SkrullZero2Strategy

    out: dict[str, Any] = {}
    model, trainer, _ = _fit(
        SkrullStrategy(cp_size=3, bucket_size=BUCKET), 3, gradient_clip_val=CLIP
    )
    out["ddp"], out["ddp_loss"] = _params(model), float(trainer.callback_metrics["train_loss"])
    model, _, _ = _fit(
        SkrullZero2Strategy(cp_size=3, bucket_size=BUCKET), 3, gradient_clip_val=CLIP
    )
    out["zero2"] = _params(model)
    started = time.perf_counter()
    model, _, recorder = _fit(
        SkrullStrategy(cp_size=3, bucket_size=BUCKET),
        3,
        gradient_clip_val=CLIP,
        precision="bf16-mixed",
    )
    out["bf16_clipped"], out["bf16_clipped_steps"] = _params(model), recorder.steps
    model, _, _ = _fit(
        SkrullZero2Strategy(cp_size=3, bucket_size=BUCKET),
        3,
        gradient_clip_val=CLIP,
        precision="bf16-mixed",
    )
    out["zero2_bf16_clipped"] = _masters(model)
    out["bf16_clipped_seconds"] = time.perf_counter() - started
    return out


# ----------------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as ckpt_dir:
        results = spawn(_four_rank_cases, 4, ckpt_dir, timeout=900)
        saved = os.path.join(ckpt_dir, "pretrained")
        results[0]["saved"] = {name: _saved(os.path.join(saved, name), VAL_DATA) for name in SAVED}
        return results


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return spawn(_three_rank_cases, 3, timeout=900)


@pytest.mark.multiprocess
def test_ddp_dp2_cp2_equals_single_process(four_ranks: list[dict[str, Any]]) -> None:
    ref, losses = reference_training(3)
    for out in four_ranks:
        assert max_diff(out["ddp"], ref) < PARAM_ATOL
        # the logged train_loss is the exact global loss of the step (mean over ranks of shares)
        assert out["ddp_loss"] == pytest.approx(losses[-1], abs=1e-5)
    steps = four_ranks[0]["ddp_steps"]
    # the case must exercise DP ranks with different micro-batch counts and several micro-batches
    assert any(s["max"] != s["min"] for s in steps)
    assert max(s["max"] for s in steps) >= 2


@pytest.mark.multiprocess
def test_zero2_dp2_cp2_equals_single_process(four_ranks: list[dict[str, Any]]) -> None:
    ref, _ = reference_training(3)
    plan_max = [s["max"] for s in four_ranks[0]["ddp_steps"]]
    for out in four_ranks:
        assert max_diff(out["zero2"], ref) < PARAM_ATOL
        # ZeRO-2 reduces in every backward: every rank ran the plan's largest count
        assert out["zero2_runs"] == plan_max


@pytest.mark.multiprocess
def test_zero2_dp2_cp2_with_gradient_clipping_equals_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    """ZeRO-2 clipping by norm (``gradient_clip_val`` becomes DeepSpeed's
    ``gradient_clipping``) at DP=2 x CP=2, the DP ranks planned different micro-batch counts
    and padded to the largest: parameters equal plain HF training with ``clip_grad_norm_`` to
    PARAM_ATOL (measured 3.7e-9). CLIP is below every step's gradient norm (0.51 to 0.61), and
    the unclipped reference lands 3.0e-2 away."""
    ref, grads = hooked_reference_training(3, clip_norm=CLIP)
    unclipped, _ = hooked_reference_training(3)
    assert min(g.norm for g in grads) > CLIP, grads  # clipping acts in every step
    assert max_diff(ref, unclipped) > 100 * PARAM_ATOL
    for out in four_ranks:
        assert max_diff(out["zero2_clipped"], ref) < PARAM_ATOL
        steps = out["zero2_clipped_steps"]
        assert any(s["max"] != s["min"] for s in steps)
        assert all(s["run"] == s["max"] for s in steps)  # padded to the plan's largest count


@pytest.mark.multiprocess
def test_zero2_dp2_cp2_bf16_mixed_with_gradient_clipping_as_close_to_float32_as_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    """bf16-mixed ZeRO-2 at DP=2 x CP=2 clipping the norm to CLIP, its float32 masters by
    docs/precision.md's rule against :func:`zero2_clipped_reference` (as at CP=3). Measured
    6.5e-3 against the reference's 6.5e-3 (bound 1.4e-2); 5% off, 5.0e-2."""
    check_zero2_bf16_clipped([out["zero2_bf16_clipped"] for out in four_ranks])
    for out in four_ranks:
        assert any(s["max"] != s["min"] for s in out["zero2_bf16_clipped_steps"])


@pytest.mark.multiprocess
def test_zero1_dp2_cp2_equals_single_process(four_ranks: list[dict[str, Any]]) -> None:
    """ZeRO stage 1 (``config={"zero_optimization": {"stage": 1}}``) at DP=2 x CP=2: the
    parameters equal plain HF training to PARAM_ATOL (measured 6.0e-8), the DP ranks planned
    different micro-batch counts in step 1 (3 and 2) and both ran 3, padded as under stage 2."""
    ref, _ = reference_training(3)
    for out in four_ranks:
        cell = out["zero1"]
        assert cell["stage"] == 1 and cell["optimizer"] == "DeepSpeedZeroOptimizer"
        assert max_diff(cell["params"], ref) < PARAM_ATOL
        assert any(s["max"] != s["min"] for s in cell["steps"])
        assert all(s["run"] == s["max"] for s in cell["steps"])
    planned = [[s["planned"] for s in out["zero1"]["steps"]] for out in four_ranks]
    assert planned[0] != planned[2]  # DP rank 0 (processes 0, 1) and DP rank 1 (2, 3)


@pytest.mark.multiprocess
def test_zero1_dp2_cp2_bf16_mixed_as_close_to_float32_as_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    """ZeRO stage 1 at DP=2 x CP=2 in ``"bf16-mixed"``: its float32 masters by docs/precision.md's
    rule against what DeepSpeed's bf16 does on one process (bf16 parameters, forward and
    backward, SGD on a float32 master copy made from the bf16 parameters, copied back), with the
    float32 update as the target. Measured d(cell) 7.0e-3, d(ref) 6.8e-3, bound 1.5e-2; the
    update 5% too large lies 5.1e-2 away."""
    fp32, _ = reference_training(3)
    delta_fp32 = update(float32_arrays(reference_model().state_dict()), fp32)
    ref_before, ref_after = zero2_reference()
    ref_distance = relative_distance(update(ref_before, ref_after), delta_fp32)
    assert ref_distance > FLOOR
    bound = RATIO * ref_distance + FLOOR
    for out in four_ranks:
        cell = out["zero1_bf16"]
        assert cell["stage"] == 1 and cell["optimizer"] == "DeepSpeedZeroOptimizer"
        delta = update(ref_before, cell["params"])
        distance = relative_distance(delta, delta_fp32)
        assert distance <= bound, (distance, ref_distance, bound)
        assert relative_distance(1.05 * delta, delta_fp32) > bound
        assert any(s["max"] != s["min"] for s in cell["steps"])
        assert all(s["run"] == s["max"] for s in cell["steps"])


def _check_hook_plans(runs: list[dict[str, Any]], case: str) -> None:
    """Every step of ``case`` planned 2 micro-batches for one DP rank and 1 for the other, and
    each rank ran its planned count (ZeRO-2, whose runs are named ``*_zero2``: the largest)."""
    padded = case.endswith("_zero2")
    for step in range(HOOK_STEPS):
        cells = [out[case]["steps"][step] for out in runs]
        planned = {cell["dp_rank"]: cell["planned"] for cell in cells}
        assert sorted(planned.values()) == [1, 2], (step, planned)
        for cell in cells:
            assert (cell["max"], cell["min"]) == (2, 1)
            assert cell["run"] == (2 if padded else cell["planned"])


@functools.cache
def _hook_reference(**kwargs: Any) -> tuple[dict[str, np.ndarray], tuple[Any, ...]]:
    return hooked_reference_training(HOOK_STEPS, seed=HOOK_SEED, batch=HOOK_BATCH, **kwargs)


@pytest.mark.multiprocess
def test_backward_override_runs_once_per_micro_batch(four_ranks: list[dict[str, Any]]) -> None:
    """A ``LightningModule.backward`` override multiplying the loss by LOSS_SCALE runs once per
    micro-batch (the strategy's earlier micro-batches and Lightning's last), so each rank's
    count is its micro-batch count, and the update equals plain HF training of the scaled loss
    to PARAM_ATOL (measured 1.2e-7); the unscaled reference lands 8.1e-2 away. Scaling only
    the last micro-batch's loss would move the rank with 2 micro-batches off it."""
    ref, _ = _hook_reference(loss_scale=LOSS_SCALE)
    unscaled, _ = _hook_reference()
    assert max_diff(ref, unscaled) > 100 * PARAM_ATOL
    _check_hook_plans(four_ranks, "scaled")
    for out in four_ranks:
        cell = out["scaled"]
        assert cell["calls"] == [s["run"] for s in cell["steps"]]
        assert max_diff(cell["params"], ref) < PARAM_ATOL


@pytest.mark.multiprocess
def test_configure_gradient_clipping_clips_the_whole_gradient_once_per_step(
    four_ranks: list[dict[str, Any]],
) -> None:
    """``configure_gradient_clipping`` clipping by value (``self.clip_gradients(...,
    "value")``) runs once per step on the averaged gradient: parameters equal one process with
    ``clip_grad_value_`` to PARAM_ATOL (measured 7.5e-9). CLIP_VALUE lies between the smallest
    and largest gradient entry of every step, and the unclipped reference lands 4.9e-2 away."""
    ref, grads = _hook_reference(clip_value=CLIP_VALUE)
    unclipped, _ = _hook_reference()
    assert all(g.smallest < CLIP_VALUE < g.largest for g in grads), grads
    assert max_diff(ref, unclipped) > 100 * PARAM_ATOL
    _check_hook_plans(four_ranks, "value_clipped")
    for out in four_ranks:
        cell = out["value_clipped"]
        assert cell["calls"] == HOOK_STEPS
        assert max_diff(cell["params"], ref) < PARAM_ATOL


def check_hook_bf16(runs: list[dict[str, Any]], case: str, **hooks: Any) -> list[float]:
    """Every rank's bf16-mixed run ``case`` of a LightningModule hook against
    :func:`~helpers.hooked_reference_training` with ``hooks``, by docs/precision.md's rule: the
    distance of its update to the float32 hooked update at most RATIO x that of the same hooked
    training under bf16 autocast on one process plus FLOOR, and the update scaled by 1.05 (and
    1.10) outside that bound. Returns ``[d(run) of each rank..., d(ref), bound]``."""
    before = float32_arrays(reference_model().state_dict())  # PlainLM's initial weights
    fp32, _ = _hook_reference(**hooks)
    autocast, _ = _hook_reference(autocast=True, **hooks)
    delta_fp32 = update(before, fp32)
    ref_distance = relative_distance(update(before, autocast), delta_fp32)
    assert ref_distance > FLOOR  # the reference's bf16 rounding shows: the bound is not vacuous
    bound = RATIO * ref_distance + FLOOR
    distances = []
    for out in runs:
        delta = update(before, out[case]["params"])
        distances.append(relative_distance(delta, delta_fp32))
        assert distances[-1] <= bound, (distances[-1], ref_distance, bound)
        for scale in (1.05, 1.10):
            assert relative_distance(scale * delta, delta_fp32) > bound, scale
    return [*distances, ref_distance, bound]


@pytest.mark.multiprocess
def test_backward_override_bf16_mixed_as_close_to_float32_as_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    """The backward override of :func:`test_backward_override_runs_once_per_micro_batch` under
    ``"bf16-mixed"`` (the forward under autocast): still once per micro-batch, on the autocast
    loss, and the update by docs/precision.md's rule against plain HF training of the scaled
    loss under bf16 autocast. Measured d(cell) 4.3e-3, d(ref) 5.0e-3, bound 1.1e-2; the update
    5% too large lies 5.0e-2 away, 10% too large 1.0e-1."""
    _check_hook_plans(four_ranks, "scaled_bf16")
    for out in four_ranks:
        cell = out["scaled_bf16"]
        assert cell["calls"] == [s["run"] for s in cell["steps"]]
    check_hook_bf16(four_ranks, "scaled_bf16", loss_scale=LOSS_SCALE)


@pytest.mark.multiprocess
def test_configure_gradient_clipping_bf16_mixed_as_close_to_float32_as_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    """The value clipping of :func:`test_configure_gradient_clipping_clips_the_whole_gradient_once_per_step`
    under ``"bf16-mixed"``: once per step, on the all-reduced float32 gradient, and the update by
    docs/precision.md's rule against plain HF training under bf16 autocast with
    ``clip_grad_value_``. CLIP_VALUE lies inside every step's range of gradient entries in the
    autocast reference too (largest 5.3e-2 to 1.0e-1). Measured d(cell) 7.8e-3, d(ref) 8.2e-3,
    bound 1.7e-2; 5% too large, 5.0e-2; 10%, 1.0e-1."""
    _, grads = _hook_reference(clip_value=CLIP_VALUE, autocast=True)
    assert all(g.smallest < CLIP_VALUE < g.largest for g in grads), grads
    _check_hook_plans(four_ranks, "value_clipped_bf16")
    for out in four_ranks:
        assert out["value_clipped_bf16"]["calls"] == HOOK_STEPS
    check_hook_bf16(four_ranks, "value_clipped_bf16", clip_value=CLIP_VALUE)


@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_lr_scheduler_steps_once_per_global_batch(
    four_ranks: list[dict[str, Any]], strategy: str
) -> None:
    """A ``LambdaLR`` warm-up with ``interval="step"`` (the CLI's) steps once per global batch,
    however many micro-batches a rank runs (ZeRO-2: padded to 2 on both DP ranks, DeepSpeed
    holding the optimizer): ``last_epoch`` equals ``global_step``, each step runs
    ``LR * warmup_factor(step)``, and the parameters equal plain HF training under the same
    schedule to PARAM_ATOL (measured 1.5e-8 for DDP and ZeRO-2); the constant-LR
    reference lands 2.7e-2 away."""
    ref, _ = _hook_reference(warmup=WARMUP)
    constant, _ = _hook_reference()
    assert max_diff(ref, constant) > 100 * PARAM_ATOL
    case = f"warmup_{strategy}"
    _check_hook_plans(four_ranks, case)
    check_warmup_cells([out[case] for out in four_ranks], ref, HOOK_STEPS, PARAM_ATOL, "params")


@pytest.mark.multiprocess
def test_validation_loss_and_perplexity_equal_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    expected = reference_loss(four_ranks[0]["ddp"], make_data(11, seed=1))
    for out in four_ranks:
        # float32 sums over 11 samples in another order: 1e-5 relative
        assert out["val_loss"] == pytest.approx(expected, rel=1e-5)
        assert out["val_ppl"] == pytest.approx(math.exp(expected), rel=1e-5)
        assert out["zero2_val_loss"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", SAVED)
def test_save_pretrained_checkpoint_loads_with_plain_transformers(
    four_ranks: list[dict[str, Any]], name: str
) -> None:
    saved = four_ranks[0]["saved"][name]
    assert saved["class"] == saved["config"]["architectures"][0] == "Qwen2ForCausalLM"
    assert saved["attention"] == "sdpa"  # transformers' default, not the Skrull attention
    # the written weights are float32 (the masters under bf16-mixed ZeRO-2), and config.json
    # says so: dtype="auto" loads them without rounding
    assert saved["config"]["dtype"] == "float32"
    assert saved["dtypes"] == ["torch.float32"]


@pytest.mark.multiprocess
def test_save_pretrained_writes_the_trained_weights(four_ranks: list[dict[str, Any]]) -> None:
    saved = four_ranks[0]["saved"]
    for out in four_ranks:
        # DDP and float32 ZeRO-2: the model's own weights, bit for bit
        assert max_diff(saved["ddp"]["params"], out["ddp"]) == 0.0
        assert max_diff(saved["zero2"]["params"], out["zero2"]) == 0.0
    # the loss of the reloaded model on one process equals the loss the strategy logged for
    # the trained weights (float32 sums over 11 samples in another order: 1e-5 relative;
    # measured 3.0e-8 under DDP and ZeRO-2)
    assert saved["ddp"]["val_loss"] == pytest.approx(four_ranks[0]["val_loss"], rel=1e-5)
    for out in four_ranks:
        assert out["zero2_trained_val_loss"] == pytest.approx(saved["zero2"]["val_loss"], rel=1e-5)


@pytest.mark.multiprocess
def test_zero2_bf16_mixed_save_pretrained_writes_the_float32_masters(
    four_ranks: list[dict[str, Any]],
) -> None:
    written = four_ranks[0]["saved"]["zero2_bf16"]["params"]
    for out in four_ranks:
        assert out["zero2_bf16_dtypes"] == ["torch.bfloat16"]  # the model holds bf16 copies
        # exactly DeepSpeed's float32 masters ...
        assert max_diff(written, out["zero2_bf16_master"]) == 0.0
        # ... not the model's bf16 copies, which are their rounding to bf16
        assert max_diff(written, out["zero2_bf16_copy"]) > 0.0
        rounded = {k: torch.from_numpy(v).bfloat16().float().numpy() for k, v in written.items()}
        assert max_diff(rounded, out["zero2_bf16_copy"]) == 0.0
        # the logged validation loss ran on the bf16 copies (see BF16_LOSS_ATOL)
        assert out["zero2_bf16_val_loss"] == pytest.approx(
            four_ranks[0]["saved"]["zero2_bf16"]["val_loss"], abs=BF16_LOSS_ATOL
        )
    # DP ranks planned different micro-batch counts (ZeRO-2 padded them to the largest)
    steps = four_ranks[0]["zero2_bf16_steps"]
    assert any(s["max"] != s["min"] for s in steps)


@pytest.mark.multiprocess
def test_named_validation_sets_log_each_sets_exact_loss(
    four_ranks: list[dict[str, Any]],
) -> None:
    short = reference_loss(four_ranks[0]["ddp"], SHORT)
    long = reference_loss(four_ranks[0]["ddp"], LONG)
    assert abs(short - long) > SETS_APART * short  # the sets are told apart
    for out in four_ranks:
        # one result per loader, in the mapping's order; no plain val_loss
        val, test = out["sets_val"], out["sets_test"]
        assert [sorted(r) for r in val] == [
            ["val_loss/short", "val_ppl/short"],
            ["val_loss/long", "val_ppl/long"],
        ]
        assert [sorted(r) for r in test] == [["test_loss/long"], ["test_loss/short"]]
        # float32 sums in another order (packed, sharded, per rank): 1e-5 relative
        for name, expected in (("short", short), ("long", long)):
            i = 0 if name == "short" else 1
            assert val[i][f"val_loss/{name}"] == pytest.approx(expected, rel=1e-5)
            assert val[i][f"val_ppl/{name}"] == pytest.approx(math.exp(expected), rel=1e-5)
            assert test[1 - i][f"test_loss/{name}"] == pytest.approx(expected, rel=1e-5)
            # ZeRO-2 (DeepSpeed's inference engine) logs the same per-set losses
            zero2 = out["zero2_sets_val"][i]
            assert sorted(zero2) == [f"val_loss/{name}", f"val_ppl/{name}"]
            assert zero2[f"val_loss/{name}"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.multiprocess
def test_named_sets_reach_the_module_with_their_dataloader_idx(
    four_ranks: list[dict[str, Any]],
) -> None:
    order = {"validation": ["short", "long"], "test": ["long", "short"]}
    sizes = {"short": len(SHORT), "long": len(LONG)}
    for stage, names in order.items():
        for out in four_ranks:
            batches = [b for b in out["sets_batches"] if b["stage"] == stage]
            # every batch carries its set's name and index, and so does every step call
            assert [b["name"] for b in batches] == sorted(
                (b["name"] for b in batches), key=names.index
            )
            for b in batches:
                assert b["name"] == names[b["dataloader_idx"]]
                assert b["calls"] == [b["dataloader_idx"]] * b["run"]
        for name in names:
            seen = [
                i
                for out in four_ranks
                for b in out["sets_batches"]
                if b["stage"] == stage and b["name"] == name and b["cp_rank"] == 0
                for i in b["samples"]
            ]
            assert sorted(seen) == list(range(sizes[name]))  # every sample once
            steps = [
                b
                for b in four_ranks[0]["sets_batches"]
                if b["stage"] == stage and b["name"] == name
            ]
            # planned like training steps: the DP ranks run different micro-batch counts
            assert any(b["max"] != b["min"] for b in steps)
    # ZeRO-2's validation of the named sets: the same plans, each set's batches in order
    for name in ("short", "long"):
        steps = [b for b in four_ranks[0]["zero2_sets_batches"] if b["name"] == name]
        assert steps and any(b["max"] != b["min"] for b in steps), name
        # every DP rank runs the plan's largest count, as in ZeRO-2's training steps
        for out in four_ranks:
            assert all(b["run"] == b["max"] for b in out["zero2_sets_batches"] if b["name"] == name)
    for out in four_ranks:
        names = [b["name"] for b in out["zero2_sets_batches"]]
        assert names == sorted(names, key=["short", "long"].index)


@pytest.mark.multiprocess
def test_bf16_mixed_runs_close_to_float32(four_ranks: list[dict[str, Any]]) -> None:
    _, losses = reference_training(1)
    for out in four_ranks:
        assert out["bf16_loss"] == pytest.approx(losses[0], abs=BF16_LOSS_ATOL)


@pytest.mark.multiprocess
def test_resume_equals_uninterrupted_run(four_ranks: list[dict[str, Any]]) -> None:
    for out in four_ranks:
        # the same batches and operations; only the order in which gloo sums the ranks'
        # gradients may change (DDP rebuilds its buckets after the first step of each run), so
        # parameters agree to float32 rounding (measured 1.2e-7)
        assert max_diff(out["resumed_2"], out["whole"]) < 1e-6
        assert max_diff(out["resumed_3"], out["whole"]) < 1e-6
        # the first steps after the checkpoints give the DP ranks different micro-batch counts
        assert all(s["max"] != s["min"] for s in out["whole_steps"][2:4])
        whole = [(s["epoch"], s["index"], s["samples"]) for s in out["whole_steps"]]
        assert [(s["epoch"], s["index"], s["samples"]) for s in out["resumed_2_steps"]] == whole[2:]
        # step 3 ends epoch 0: the resumed run starts epoch 1 from its first batch
        assert [(s["epoch"], s["index"], s["samples"]) for s in out["resumed_3_steps"]] == whole[3:]


@pytest.mark.multiprocess
def test_zero2_resume_equals_uninterrupted_run(four_ranks: list[dict[str, Any]]) -> None:
    for out in four_ranks:
        # the same batches, optimizer partitions restored from DeepSpeed's checkpoint directory;
        # float32 rounding of the summation order only (as for DDP above)
        assert max_diff(out["zero2_resumed"], out["zero2_whole"]) < 1e-6
        whole = [(s["epoch"], s["index"], s["samples"]) for s in out["zero2_whole_steps"]]
        got = [(s["epoch"], s["index"], s["samples"]) for s in out["zero2_resumed_steps"]]
        assert got == whole[2:] and len(got) == 2
        # the plans gave the DP ranks different micro-batch counts (ZeRO-2 pads them to the
        # largest, so the pad has to be restored on resume as well)
        assert all(s["max"] != s["min"] for s in out["zero2_whole_steps"][2:4])


@pytest.mark.multiprocess
def test_zero2_bf16_mixed_resume_equals_uninterrupted_run(
    four_ranks: list[dict[str, Any]],
) -> None:
    """bf16-mixed ZeRO-2 resumed from step 2 (mid-epoch, momentum) equals the uninterrupted
    run, its float32 masters and its bf16 model copies alike: the masters come back from
    DeepSpeed's checkpoint, not rebuilt from the bf16 copies. The same batches and operations
    (DeepSpeed's reduce-scatter buckets do not change between runs): measured bitwise equal;
    1e-6 allows float32 summation order only. A resume that rebuilt the masters from the bf16
    copies would start 3.5e-3 off at most (the largest master-to-copy difference after 4
    steps; at least 1e-4 asserted), far outside it."""
    for out in four_ranks:
        assert max_diff(out["zero2_bf16_resumed_master"], out["zero2_bf16_whole_master"]) < 1e-6
        assert max_diff(out["zero2_bf16_resumed"], out["zero2_bf16_whole"]) < 1e-6
        assert max_diff(out["zero2_bf16_whole_master"], out["zero2_bf16_whole"]) > 1e-4
        whole = [(s["epoch"], s["index"], s["samples"]) for s in out["zero2_bf16_whole_steps"]]
        got = [(s["epoch"], s["index"], s["samples"]) for s in out["zero2_bf16_resumed_steps"]]
        assert got == whole[2:] and len(got) == 2
        assert all(s["max"] != s["min"] for s in out["zero2_bf16_whole_steps"][2:4])


@pytest.mark.multiprocess
def test_bf16_mixed_resume_equals_uninterrupted_run(four_ranks: list[dict[str, Any]]) -> None:
    """DDP in bf16-mixed resumed from step 2 (mid-epoch, momentum) against the uninterrupted
    run: float32 parameters, gradients and momentum, the same micro-batches. RESUME_BF16_ATOL
    says how close, and why not bitwise."""
    for out in four_ranks:
        diff = max_diff(out["bf16_resumed"], out["bf16_whole"])
        assert diff <= RESUME_BF16_ATOL, diff
        # the checkpoint's parameters are where the resumed run started; its two steps moved
        # them far more than the tolerance, so an update 5% off fails it
        delta = update(out["bf16_resumed_start"], out["bf16_resumed"])
        assert np.abs(0.05 * delta).max() > 10 * RESUME_BF16_ATOL
        whole = [(s["epoch"], s["index"], s["samples"]) for s in out["bf16_whole_steps"]]
        got = [(s["epoch"], s["index"], s["samples"]) for s in out["bf16_resumed_steps"]]
        assert got == whole[2:] and len(got) == 2
        assert all(s["max"] != s["min"] for s in out["bf16_whole_steps"][2:4])


@pytest.mark.multiprocess
def test_bf16_mixed_with_gradient_clipping_as_close_to_float32_as_single_process(
    four_ranks: list[dict[str, Any]],
) -> None:
    """docs/precision.md's rule with the gradient's norm clipped to CLIP in each of 3 steps:
    the update's distance to the float32 clipped reference's at most RATIO x single-process
    clipped autocast training's plus FLOOR. Measured 3.5e-3 against the reference's 4.6e-3
    (bound 1.0e-2); the update scaled by 1.05 lies 5.0e-2 away."""
    check_bf16_clipped(four_ranks)
    for out in four_ranks:
        assert any(s["max"] != s["min"] for s in out["bf16_clipped_steps"])


def check_bf16_clipped(runs: list[dict[str, Any]]) -> list[float]:
    """Every rank's ``bf16_clipped`` run against :func:`clipped_reference` by the rule: the
    distance of its update to the float32 clipped update at most RATIO x the clipped autocast
    reference's plus FLOOR, the update scaled by 1.05 outside that bound, and clipping active
    (every step's gradient norm above :data:`CLIP` in both references). Returns
    ``[d(cell) of each rank..., d(ref), bound]``."""
    before, fp32_after, fp32_norms = clipped_reference(False)
    ref_before, ref_after, ref_norms = clipped_reference(True)
    assert min(fp32_norms + ref_norms) > CLIP, (fp32_norms, ref_norms)
    unclipped, _ = reference_training(3)
    assert max_diff(unclipped, fp32_after) > 1e-3  # clipping changes the update
    delta_fp32 = update(before, fp32_after)
    ref_distance = relative_distance(update(ref_before, ref_after), delta_fp32)
    assert ref_distance > FLOOR  # the reference's bf16 rounding shows: the bound is not vacuous
    bound = RATIO * ref_distance + FLOOR
    distances = []
    for out in runs:
        delta = update(before, out["bf16_clipped"])
        distances.append(relative_distance(delta, delta_fp32))
        assert distances[-1] <= bound, (distances[-1], ref_distance)
        assert relative_distance(1.05 * delta, delta_fp32) > bound
    return [*distances, ref_distance, bound]


@pytest.mark.multiprocess
def test_every_sample_trained_once_per_epoch(four_ranks: list[dict[str, Any]]) -> None:
    num_samples = len(make_data())
    for run in ("whole_steps", "resumed_2_steps"):
        per_epoch: dict[int, list[int]] = {}
        for out in four_ranks:
            for step in out[run]:
                if step["cp_rank"] == 0:  # the CP ranks of a DP rank share its micro-batches
                    per_epoch.setdefault(step["epoch"], []).extend(step["samples"])
        if run == "resumed_2_steps":  # add the two steps trained before the checkpoint
            for out in four_ranks:
                for step in out["whole_steps"][:2]:
                    if step["cp_rank"] == 0:
                        per_epoch[step["epoch"]].extend(step["samples"])
        assert sorted(per_epoch) == [0, 1]
        for samples in per_epoch.values():
            assert sorted(samples) == list(range(num_samples))


@pytest.mark.multiprocess
def test_cp3_with_gradient_clipping_equals_single_process(
    three_ranks: list[dict[str, Any]],
) -> None:
    ref, losses = reference_training(3, clip=CLIP)
    unclipped, _ = reference_training(3)
    assert max_diff(ref, unclipped) > 1e-3  # clipping is active in this case
    for out in three_ranks:
        assert max_diff(out["ddp"], ref) < PARAM_ATOL
        assert out["ddp_loss"] == pytest.approx(losses[-1], abs=1e-5)
        assert max_diff(out["zero2"], ref) < PARAM_ATOL


@pytest.mark.multiprocess
def test_cp3_bf16_mixed_with_gradient_clipping_as_close_to_float32_as_single_process(
    three_ranks: list[dict[str, Any]],
) -> None:
    """CP=3 (one DP rank: the 3 processes are one CP group, so there are no DP ranks whose
    micro-batch counts could differ) in bf16-mixed with the gradient's norm clipped to CLIP,
    below every step's gradient norm: docs/precision.md's rule against the clipped references,
    as at DP=2 x CP=2. Measured 3.4e-3 against the reference's 4.6e-3 (bound 1.0e-2; every
    step's gradient norm 0.51 to 0.61, CLIP 0.05); the update scaled by 1.05 lies 5.0e-2 away."""
    check_bf16_clipped(three_ranks)
    for out in three_ranks:
        assert len(out["bf16_clipped_steps"]) == 3
        assert all(s["max"] == s["min"] == s["run"] for s in out["bf16_clipped_steps"])


@pytest.mark.multiprocess
def test_cp3_zero2_bf16_mixed_with_gradient_clipping_as_close_to_float32_as_single_process(
    three_ranks: list[dict[str, Any]],
) -> None:
    """ZeRO-2 at CP=3 in bf16-mixed with the gradient's norm clipped to CLIP: its float32
    masters (what trained, and what ``save_pretrained`` writes) by the rule against
    :func:`zero2_clipped_reference`'s masters. Measured 6.8e-3 against the reference's 6.5e-3
    (bound 1.4e-2; gradient norms 0.51 to 0.61, CLIP 0.05); 5% off, 5.1e-2. Not the bf16
    copies: the clipped steps are so small that rounding the weights to bf16 hides much of them
    (cell and reference copies both 8.8e-2 from float32), and a 5% error lands inside that
    bound (1.05e-1 against 1.8e-1)."""
    check_zero2_bf16_clipped([out["zero2_bf16_clipped"] for out in three_ranks])


def check_zero2_bf16_clipped(masters: list[dict[str, np.ndarray]]) -> list[float]:
    """Each run's float32 ZeRO-2 masters after 3 bf16-mixed steps clipped to :data:`CLIP`
    against :func:`zero2_clipped_reference` by docs/precision.md's rule: the distance of the
    update to the float32 clipped update at most RATIO x the reference's plus FLOOR, the update
    scaled by 1.05 outside that bound, and clipping active in every step of the reference.
    Returns ``[d(run) of each..., d(ref), bound]``."""
    before, fp32_after, _ = clipped_reference(False)
    ref_before, ref_after, norms = zero2_clipped_reference()
    assert min(norms) > CLIP, norms  # clipping acts in every step
    delta_fp32 = update(before, fp32_after)
    ref_distance = relative_distance(update(ref_before, ref_after), delta_fp32)
    assert ref_distance > FLOOR
    bound = RATIO * ref_distance + FLOOR
    distances = []
    for master in masters:
        delta = update(ref_before, master)
        distances.append(relative_distance(delta, delta_fp32))
        assert distances[-1] <= bound, (distances[-1], ref_distance)
        assert relative_distance(1.05 * delta, delta_fp32) > bound
    return [*distances, ref_distance, bound]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(WINDOWED))
def test_sliding_window_models_equal_single_process(
    four_ranks: list[dict[str, Any]], name: str
) -> None:
    """DP=2 x CP=2, float32, 2 SGD steps: parameters equal plain HF training (eager attention,
    transformers' own window mask) to PARAM_ATOL, as the dense models' (measured 1.0e-8 for
    the Mistral, 6.0e-8 for the Qwen2, 3.7e-8 for the Gemma 3); with a window longer than every
    sequence the reference lands 6.4e-3 / 6.8e-3 / 5.6e-2 away, so the window is applied, not
    ignored."""
    before, after = windowed_reference(name)
    _, full = windowed_reference(name, window=False)
    assert max_diff(full, after) > 100 * PARAM_ATOL  # the window bites on this data
    for out in four_ranks:
        cell = out[("windowed", name, "32-true")]
        assert max_diff(cell["before"], before) == 0.0
        assert max_diff(cell["after"], after) < PARAM_ATOL
        # different micro-batch counts on the DP ranks in some step
        assert any(s["max"] != s["min"] for s in cell["steps"])
        assert len(cell["steps"]) == WINDOWED_STEPS


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", [n for n, p in WINDOWED_CASES if p == "bf16-mixed"])
def test_sliding_window_bf16_mixed_as_close_to_float32_as_single_process(
    four_ranks: list[dict[str, Any]], name: str
) -> None:
    """docs/precision.md's rule on the windowed models: the update's distance to the float32
    reference's, relative to the latter, at most RATIO x single-process autocast's plus FLOOR.
    Measured (cell / reference, bound): Mistral 3.5e-3 / 4.6e-3 (1.0e-2), Gemma 3 3.5e-2 /
    2.9e-2 (6.0e-2), Phi-3 3.6e-3 / 4.7e-3 (1.0e-2), EXAONE 4 9.4e-3 / 1.1e-2 (2.3e-2), OLMo 3
    1.1e-2 / 9.7e-3 (2.0e-2), SmolLM3 3.6e-3 / 4.6e-3 (1.0e-2). The update scaled by 1.05 lies
    4.9e-2 to 5.0e-2 from float32 for all but the Gemma 3, outside their bounds; the Gemma 3's
    lies 6.03e-2 away, just outside its bound of 5.99e-2 (not asserted here: it is too close to
    hold; tests/models/test_families_precision.py asserts it on one process, bound 2.8e-2)."""
    fp32_before, fp32_after = windowed_reference(name)
    delta_fp32 = update(fp32_before, fp32_after)
    ref_distance = relative_distance(update(*windowed_reference(name, True)), delta_fp32)
    assert ref_distance > FLOOR  # the reference's bf16 rounding shows: the bound is not vacuous
    for out in four_ranks:
        cell = out[("windowed", name, "bf16-mixed")]
        assert max_diff(cell["before"], fp32_before) == 0.0
        distance = relative_distance(update(cell["before"], cell["after"]), delta_fp32)
        assert distance <= RATIO * ref_distance + FLOOR, (distance, ref_distance)
        assert any(s["max"] != s["min"] for s in cell["steps"])
