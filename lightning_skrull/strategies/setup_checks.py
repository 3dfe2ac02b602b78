"""What the Skrull strategies refuse at setup, each with the rule and the fix.

:func:`check_trainer` runs first in every strategy's ``setup``: the device, gradient
accumulation, the attention backend and ``bucket_size="auto"`` against the device, a model
sharded by another Trainer (:func:`refuse_model_sharded_elsewhere`), weight averaging, a
compiled model, metrics synced on step and manual optimization. The other checks run where the
strategy knows enough: meta tensors after the model is found (:func:`refuse_meta_tensors`),
rounded master weights when training starts (:class:`RoundedMasters`), a vision-language
model's image token in every batch on the host (:func:`refuse_image_tokens`).

``torch.compile`` under the Skrull strategies: a user compiles in one of three ways:

- ``self.model = torch.compile(AutoModelForCausalLM.from_pretrained(...))``: an
  ``OptimizedModule`` whose ``_orig_mod`` is the model (the strategy finds the model inside it);
- ``self.model.compile()`` (``nn.Module.compile``, in place; also per decoder layer);
- ``trainer.fit(torch.compile(module))``: Lightning unwraps the LightningModule and compiles its
  step methods (``LightningModule._compiler_ctx``); Lightning itself refuses it under strategies
  other than DDP and FSDP1.

Under :class:`~lightning_skrull.SkrullStrategy` all three train exactly as the eager model does:
the Skrull attention is excluded from compilation
(:data:`~lightning_skrull.attention.dispatch.COMPILE_REASON`), so dynamo breaks the graph at each
layer's attention and compiles the rest. :class:`~lightning_skrull.SkrullFSDPStrategy` and
:class:`~lightning_skrull.SkrullZero2Strategy` refuse a compiled model at setup
(:func:`refuse_compiled`, with their reasons).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule
from torch.distributed.fsdp import FSDPModule
from torchmetrics import Metric

from lightning_skrull.config import AUTO_BUCKET, SkrullConfig
from lightning_skrull.data.batch import SkrullBatch
from lightning_skrull.data.collate import RankBatch
from lightning_skrull.models.families.vision_language import refuse_image_token
from lightning_skrull.runtime.meta_init import agree_on_meta_tensors
from lightning_skrull.strategies.weight_averaging import (
    refuse_batch_norm_update,
    refuse_weight_averaging,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl

SUPPORTED_ACCELERATORS = ("cpu", "cuda")
"""Device types the strategies run on (SDPA attention on CPU, SDPA or FlashAttention varlen
on CUDA)."""


def accumulation_message(strategy: str, factor: int) -> str:
    """Why ``accumulate_grad_batches=factor`` is refused under ``strategy``, and the fix."""
    return (
        f"Trainer(accumulate_grad_batches={factor}) is not supported by "
        f"{strategy}: one global batch is one optimizer step and its "
        "micro-batches are already accumulated. Set SkrullDataModule(global_batch_size=...) "
        "to the number of sequences per step instead."
    )


def check_trainer(
    trainer: pl.Trainer,
    config: SkrullConfig,
    device: torch.device,
    *,
    strategy: str,
    own_sharded_model: nn.Module | None,
    weight_averaging_refusal: str | None,
    compile_refusal: str | None,
) -> None:
    """Refuse Trainer settings that would silently change the math.

    Args:
        trainer: the Trainer setting the strategy up.
        config: the strategy's config.
        device: the strategy's root device.
        strategy: the strategy's class name, for the messages.
        own_sharded_model: the model this strategy sharded in an earlier set-up, if any.
        weight_averaging_refusal: why weight averaging cannot run, or ``None``.
        compile_refusal: why a compiled model cannot train, or ``None``.

    Raises:
        ValueError: a refused setting; the message names it, the rule and the fix.
    """
    accelerator = trainer.accelerator
    device_type = device.type
    if device_type not in SUPPORTED_ACCELERATORS:
        raise ValueError(
            f"{strategy} runs on {SUPPORTED_ACCELERATORS} devices, but the Trainer "
            f"uses {type(accelerator).__name__} ({device_type}); pass accelerator='cpu' or "
            "'gpu'."
        )
    if trainer.accumulate_grad_batches != 1:
        raise ValueError(accumulation_message(strategy, trainer.accumulate_grad_batches))
    callbacks = cast(list[Any], getattr(trainer, "callbacks", []))
    for callback in callbacks:
        if not isinstance(callback, GradientAccumulationScheduler):
            continue
        scheduling: dict[int, int] = callback.scheduling
        if any(factor != 1 for factor in scheduling.values()):
            raise ValueError(
                f"GradientAccumulationScheduler(scheduling={scheduling}) would set "
                "Trainer.accumulate_grad_batches above 1 in a later epoch. "
                + accumulation_message(strategy, max(scheduling.values()))
                + " To grow the batch during training, use a new fit with a larger "
                "global_batch_size."
            )
    if config.attention_backend == "flash" and device_type != "cuda":
        raise ValueError(
            f"attention_backend='flash' needs CUDA (FlashAttention kernels), but the Trainer "
            f"runs on {device_type}; use attention_backend='sdpa' or 'auto' there."
        )
    if config.bucket_size == AUTO_BUCKET and device_type != "cuda":
        raise ValueError(
            f"bucket_size='auto' measures CUDA peak memory, but the Trainer runs on "
            f"{device_type}; give bucket_size as a number of tokens per CP rank (or None to "
            "fit the longest sequence of the data)."
        )
    module = trainer.lightning_module
    refuse_model_sharded_elsewhere(module, strategy=strategy, own=own_sharded_model)
    if weight_averaging_refusal is not None:
        refuse_weight_averaging(trainer, strategy, weight_averaging_refusal)
    else:
        refuse_batch_norm_update(trainer, module, strategy)
    if compile_refusal is not None:
        refuse_compiled(module, strategy, compile_refusal)
    refuse_metrics_synced_on_step(module)
    if not module.automatic_optimization:
        raise ValueError(
            f"{strategy} needs automatic optimization: it runs the training_step "
            "once per micro-batch and owns the backward of each. Remove "
            "`self.automatic_optimization = False` from the LightningModule."
        )


def refuse_model_sharded_elsewhere(
    module: nn.Module, *, strategy: str, own: nn.Module | None
) -> None:
    """Refuse a LightningModule whose model FSDP2 sharded before, unless this strategy did
    (``own``: the model it sharded in an earlier set-up).

    After ``trainer.fit(module)`` under ``SkrullFSDPStrategy`` the module's parameters are
    that strategy's DTensor shards, on its device mesh. A second Trainer (a notebook's
    ``L.Trainer(...).validate(module)``) cannot set them up again: FSDP2 cannot shard a
    module twice, DDP cannot broadcast DTensors, and casting them for a new precision would
    change the first Trainer's model. Checked first in ``setup``, before anything touches
    the module.

    Raises:
        ValueError: a submodule is an ``FSDPModule`` this strategy did not shard; the message
            names it and the fix.
    """
    if own is not None and any(sub is own for sub in module.modules()):
        return
    sharded = [(n, m) for n, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        return
    name, sub = sharded[0]
    shown = next(c for c in type(sub).__mro__ if not issubclass(c, FSDPModule)).__name__
    raise ValueError(
        f"{strategy}: the LightningModule's {name or 'module'!r} ({shown}) is already "
        "sharded by FSDP2 (fully_shard): an earlier Trainer's SkrullFSDPStrategy sharded it "
        "in its fit, validate or test, and its parameters are now that strategy's DTensor "
        f"shards, which a new Trainer's {strategy} cannot set up again. Call validate, "
        "test or fit with the Trainer that sharded it (trainer.validate(module, "
        "datamodule=...)); or write the trained weights with that Trainer's "
        "trainer.strategy.save_pretrained(path) (on every rank) and give the new Trainer a "
        "new LightningModule whose model is AutoModelForCausalLM.from_pretrained(path)."
    )


def refuse_metrics_synced_on_step(module: nn.Module) -> None:
    """Refuse torchmetrics that sync in every ``forward`` (a collective per micro-batch)."""
    for name, metric in module.named_modules():
        if isinstance(metric, Metric) and metric.dist_sync_on_step:
            raise ValueError(
                f"the LightningModule's metric {name!r} ({type(metric).__name__}) was built with "
                "dist_sync_on_step=True, which syncs it across ranks in every call, i.e. once "
                "per micro-batch; DP ranks run different numbers of micro-batches per step, so "
                "the run would hang. Build it with dist_sync_on_step=False (the default): its "
                "state still accumulates every micro-batch, and compute() syncs once per epoch."
            )


def refuse_meta_tensors(
    module: nn.Module, hf_model: nn.Module, device: torch.device, *, strategy: str
) -> None:
    """Refuse, on every rank (one all-reduce), a model that some rank built on the meta
    device: a strategy that keeps a full replica per rank has nothing to fill it from.

    Raises:
        ValueError: some rank holds meta tensors; the message names the fix.
    """
    meta = agree_on_meta_tensors(module, hf_model, device)
    if meta.anywhere:
        raise ValueError(
            f"{strategy} keeps a full copy of the model on every rank, but some "
            f"rank built it on the meta device{meta.on_this_rank()}, without weights (as "
            "from_pretrained_on_rank_zero does on ranks other than 0). Use "
            "SkrullFSDPStrategy, which shards the model and fills every rank from rank 0's "
            "weights, or load the weights on every rank (AutoModelForCausalLM."
            "from_pretrained; SkrullCausalLM(load_on_rank_zero=False))."
        )


def refuse_image_tokens(hf_model: nn.Module | None, batch: Any) -> None:
    """Refuse a vision-language model's image token in a batch still on the host, once per
    batch (:func:`~lightning_skrull.models.families.vision_language.refuse_image_token`): the
    model's forward pre-hook reads no tensor values, so the check costs no device sync."""
    if hf_model is None or not isinstance(batch, (SkrullBatch, RankBatch)):
        return  # a batch of another type is refused by the step itself
    rank_batch = batch.rank_batch if isinstance(batch, SkrullBatch) else batch
    for i, mb in enumerate(rank_batch.micro_batches):
        where = f"micro-batch {i} (samples {list(mb.sample_indices)}) of this rank's batch"
        refuse_image_token(mb.inputs["input_ids"], hf_model.config, where)


MASTERS_LEFT_IN_AN_OPTIMIZER: weakref.WeakKeyDictionary[nn.Module, str] = (
    weakref.WeakKeyDictionary()
)
"""Hugging Face models that a fit trained with its float32 master weights apart from the
model (:attr:`SkrullStrategyMixin.masters_apart_in`: DeepSpeed's 16-bit optimizers), with that
fit's strategy and precision. The masters stayed in that fit's optimizer; the model's
parameters hold their 16-bit copies, so a later fit would start from rounded weights unless it
resumes a checkpoint."""


def refuse_rounded_masters(
    hf_model: nn.Module,
    resumes: bool,
    strategy: str,
    precision: str,
    masters_apart_in: tuple[str, ...],
) -> None:
    """Refuse a fit, without a checkpoint to resume, of a model whose float32 master weights
    an earlier fit left in its optimizer (after the checkpoint, if any, is restored; every
    rank alike, as every rank ran the same fits); note this fit's when it keeps them apart
    (``precision`` in ``masters_apart_in``), in :data:`MASTERS_LEFT_IN_AN_OPTIMIZER`.

    Raises:
        ValueError: the model's parameters hold 16-bit copies of an earlier fit's masters.
    """
    earlier = MASTERS_LEFT_IN_AN_OPTIMIZER.get(hf_model)
    if earlier is not None and not resumes:
        raise ValueError(
            f"{strategy}: this model was trained by an earlier fit of "
            f"{earlier} in this process. DeepSpeed kept its float32 master weights in that "
            "fit's optimizer and the model's parameters hold their 16-bit copies, so this "
            "fit would start from weights rounded to 16 bits (up to 2^-8 of each, in bf16). "
            "Resume the earlier fit from one of its "
            "checkpoints instead, which hold the masters (trainer.fit(module, data, "
            "ckpt_path=...) with a larger max_epochs or max_steps), or write the trained "
            "model with trainer.strategy.save_pretrained(path) after that fit and train a "
            "module loaded from it."
        )
    if precision in masters_apart_in:
        MASTERS_LEFT_IN_AN_OPTIMIZER[hf_model] = f"{strategy} in {precision!r}"


def compiled_forms(module: nn.Module) -> list[str]:
    """How ``module`` (or something inside it) was compiled, one entry per compiled piece:
    ``"torch.compile(<name>)"`` for an ``OptimizedModule`` submodule,
    ``"<name>.compile()"`` for a submodule compiled in place, ``"torch.compile(module)"`` for a
    LightningModule compiled whole and unwrapped by Lightning. Empty when nothing is compiled.
    """
    forms: list[str] = []
    if getattr(module, "_compiler_ctx", None) is not None:
        forms.append("torch.compile(module)")
    for name, sub in module.named_modules(remove_duplicate=False):
        shown = name or "module"
        if isinstance(sub, OptimizedModule):
            forms.append(f"torch.compile({shown})")
        elif getattr(sub, "_compiled_call_impl", None) is not None:
            forms.append(f"{shown}.compile()")
    return forms


def refuse_compiled(module: nn.Module, strategy: str, reason: str) -> None:
    """Refuse a compiled model under ``strategy``, for ``reason``.

    Raises:
        ValueError: ``module`` holds a compiled piece (:func:`compiled_forms`); the message names
            it, the reason and the fix.
    """
    forms = compiled_forms(module)
    if not forms:
        return
    shown = ", ".join(forms[:3]) + (f" and {len(forms) - 3} more" if len(forms) > 3 else "")
    raise ValueError(
        f"{shown}: a compiled model is not supported under {strategy}: {reason}. Train the "
        "model uncompiled under this strategy, or compiled (torch.compile of the model, "
        "model.compile() or trainer.fit(torch.compile(module))) under SkrullStrategy (DDP), "
        "where it trains as the eager model does."
    )


def refuse_predict(strategy: str) -> None:
    """Refuse ``trainer.predict``: generation needs a KV cache.

    Raises:
        RuntimeError: always; the message names the ways to generate instead.
    """
    raise RuntimeError(
        f"{strategy} does not support trainer.predict: generation needs a KV "
        "cache, which context-parallel attention does not keep. Generate from a hook "
        "inside `with trainer.strategy.generating() as model:` (e.g. in "
        "on_validation_epoch_end), or predict with a plain strategy (e.g. 'ddp') on an "
        "unpatched model."
    )
