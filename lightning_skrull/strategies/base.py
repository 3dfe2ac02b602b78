"""The shared base of the Skrull strategies: one Skrull global batch per optimizer step.

:class:`SkrullStrategyMixin` is put in front of a Lightning data-parallel strategy and adds:

- the DP x CP process groups, CP innermost (``cp_rank = rank % cp_size``), built right after
  the default process group exists;
- the Hugging Face model found inside the LightningModule and switched to the ``"skrull"``
  attention before it is wrapped;
- a ``training_step`` that takes this rank's :class:`~lightning_skrull.data.collate.RankBatch`
  (from :class:`~lightning_skrull.data.datamodule.SkrullDataModule`) and runs the
  LightningModule's own ``training_step`` once per micro-batch inside that micro-batch's attention
  context. All micro-batches but the last run forward and backward right there without gradient
  sync; the last one's loss goes back to Lightning, whose backward syncs the gradients once. DP
  ranks may have different micro-batch counts: only the last backward communicates.

The concrete strategies are :class:`~lightning_skrull.strategies.ddp.SkrullStrategy` (DDP) and
:class:`~lightning_skrull.strategies.deepspeed.SkrullZero2Strategy` (DeepSpeed ZeRO-2).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import GradientAccumulationScheduler, LearningRateFinder
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.memory import recursive_detach
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from torchmetrics import Metric
from typing_extensions import override

from lightning_skrull.config import AUTO_BUCKET, SkrullConfig
from lightning_skrull.data.batch import LOSS_KEYS, CostModelSchedule, PlanStats, SkrullBatch
from lightning_skrull.data.collate import MicroBatch, RankBatch
from lightning_skrull.data.dataset import IGNORE_INDEX
from lightning_skrull.models.adapters import check_checkpointing_gradients
from lightning_skrull.models.chunked_loss import (
    FUSED_KERNEL_MODULES,
    check_loss_kernel,
    note_missing_logits,
)
from lightning_skrull.models.generation import plain_attention
from lightning_skrull.models.modes import train_mode_for_fit
from lightning_skrull.models.multimodal import refuse_image_token, text_config
from lightning_skrull.models.patching import find_hf_model, prepare_model
from lightning_skrull.models.saving import check_save_dtype, cpu_state_dict, write_pretrained
from lightning_skrull.models.token_loss import (
    CUSTOM_LOSS_MESSAGE,
    CustomLossWarning,
    observe_token_mean_losses,
)
from lightning_skrull.runtime.engine import check_same_plan, micro_batch_context
from lightning_skrull.runtime.memory import (
    AUTO_PROBE_TOKENS,
    AUTO_SAFETY_MARGIN,
    NONLINEAR_FIT_ERROR,
    MemoryFit,
    ProbeStep,
    auto_bucket_size,
    describe_fit,
)
from lightning_skrull.runtime.meta_init import agree_on_meta_tensors, meta_tensor_names
from lightning_skrull.runtime.process_groups import ParallelLayout, build_process_groups
from lightning_skrull.scheduling import CostModel
from lightning_skrull.strategies.calibration import CHECKPOINT_KEY, StepCalibration
from lightning_skrull.strategies.checkpoint_kinds import CheckpointKind, refuse_other_kind
from lightning_skrull.strategies.compiled import refuse_compiled
from lightning_skrull.strategies.step_logging import StepLogs, combine_outputs
from lightning_skrull.strategies.stopping import StopAgreement
from lightning_skrull.strategies.trainable import TrainableChange, TrainableParameters
from lightning_skrull.strategies.weight_averaging import (
    check_averaged_pairs,
    refuse_batch_norm_update,
    refuse_weight_averaging,
)

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

SUPPORTED_ACCELERATORS = ("cpu", "cuda")
"""Device types the strategies run on (SDPA attention on CPU, SDPA or FlashAttention varlen on CUDA)."""

MASTERS_LEFT_IN_AN_OPTIMIZER: weakref.WeakKeyDictionary[torch.nn.Module, str] = (
    weakref.WeakKeyDictionary()
)
"""Hugging Face models that a fit trained with its float32 master weights apart from the
model (:attr:`SkrullStrategyMixin.masters_apart_in`: DeepSpeed's 16-bit optimizers), with that
fit's strategy and precision. The masters stayed in that fit's optimizer; the model's
parameters hold their 16-bit copies, so a later fit would start from rounded weights unless it
resumes a checkpoint."""


def _refuse_metrics_synced_on_step(module: torch.nn.Module) -> None:
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


def _supervised_tokens(mb: MicroBatch) -> Tensor:
    """This rank's supervised tokens in ``mb``, as a 0-dim tensor (no host sync)."""
    return (mb.inputs["shift_labels"] != IGNORE_INDEX).sum()


class SkrullStrategyMixin(ParallelStrategy):
    """What every Skrull strategy adds to a Lightning data-parallel strategy.

    The concrete classes mix this in front of a Lightning strategy (``DDPStrategy`` or
    ``DeepSpeedStrategy``) and set the two hooks that differ: how an earlier micro-batch's
    backward is kept from syncing, and whether every DP rank must run the same number of
    micro-batches.
    """

    _skrull_config: SkrullConfig
    _skrull_layout: ParallelLayout | None
    _skrull_cost_model: CostModel | None
    _time_last_micro_batch = True
    """Time the last micro-batch for online calibration (its end is the last gradient hook of
    Lightning's backward); a strategy whose hooks cannot mark that end without the DP gradient
    sync leaves it out (its earlier micro-batches are still timed)."""
    _stashed_grads: list[tuple[torch.nn.Parameter, Tensor]]
    _step_start: float | None
    _step_tokens: int

    masters_apart_in: tuple[str, ...] = ()
    """The precisions in which the optimizer steps float32 master weights kept apart from the
    model's parameters, which hold 16-bit copies of them (DeepSpeed's ``bf16`` and ``fp16``);
    a later fit of the model without a checkpoint is refused (see
    :data:`MASTERS_LEFT_IN_AN_OPTIMIZER`)."""

    requires_equal_micro_batches: bool = False
    """Whether every DP rank must run the same number of micro-batches per step (ZeRO-2
    reduces gradients in every backward, so it does; DDP syncs only the last)."""

    weight_averaging_refusal: str | None = None
    """Why Lightning's weight-averaging callbacks cannot run under this strategy (refused at
    setup, :func:`~lightning_skrull.strategies.weight_averaging.refuse_weight_averaging`), or
    ``None`` where they average exactly what one process would."""

    checkpoint_kinds: tuple[CheckpointKind, ...] = ("file",)
    """The checkpoints this strategy reads (:mod:`~lightning_skrull.strategies.checkpoint_kinds`);
    another kind is refused when loaded, naming what wrote it and the fix."""

    compile_refusal: str | None = None
    """Why a compiled model (``torch.compile`` of the model, ``model.compile()``, or
    ``trainer.fit(torch.compile(module))``) cannot train under this strategy (refused at setup,
    :func:`~lightning_skrull.strategies.compiled.refuse_compiled`), or ``None`` where it trains
    as the eager model does."""

    def _init_skrull(self, config: SkrullConfig) -> None:
        # the name always (a misspelt kernel is refused even while the loss is dense);
        # whether a fused kernel's package is installed only where the chunked loss runs
        check_loss_kernel(
            config.loss_kernel,
            installed=None if config.chunked_loss else tuple(FUSED_KERNEL_MODULES),
        )
        self._skrull_config = config
        self._skrull_layout = None
        self._skrull_cost_model = None
        self._stashed_grads = []
        self._step_start = None
        self._step_tokens = 0
        self._last_context: ExitStack | None = None
        self._memory_fit: MemoryFit | None = None
        self._hf_model: torch.nn.Module | None = None
        self._loss_hook: RemovableHandle | None = None
        self._token_loss_hook: RemovableHandle | None = None
        self._check_loss_rule = False
        self._in_micro_batches = False
        self._calibration: StepCalibration | None = None
        self._calibration_state: dict[str, Any] | None = None
        self._global_loss_out = False
        self._stop_agreement: StopAgreement | None = None
        self._out_of_step: str | None = None
        self._trainable: TrainableParameters | None = None

    # ------------------------------------------------------------------ properties
    @property
    def skrull_config(self) -> SkrullConfig:
        """The strategy's :class:`~lightning_skrull.config.SkrullConfig`."""
        return self._skrull_config

    @property
    def parallel_layout(self) -> ParallelLayout:
        """This process's place in the DP x CP world and its groups.

        Raises:
            RuntimeError: before the Trainer set up the process group.
        """
        if self._skrull_layout is None:
            raise RuntimeError(
                f"{type(self).__name__}.parallel_layout is known only after the Trainer set up "
                "the process group (trainer.fit / validate); read it from a hook such as "
                "setup() or train_dataloader()."
            )
        return self._skrull_layout

    @property
    def cp_size(self) -> int:
        """Ranks in one CP group."""
        return self._skrull_config.cp_size

    @property
    def dp_size(self) -> int:
        """Number of DP ranks (CP groups)."""
        return self.parallel_layout.dp_size

    @property
    def dp_rank(self) -> int:
        """This process's DP rank (``global_rank // cp_size``)."""
        return self.parallel_layout.dp_rank

    @property
    def cp_rank(self) -> int:
        """This process's rank inside its CP group (``global_rank % cp_size``)."""
        return self.parallel_layout.cp_rank

    @property
    def cost_model(self) -> CostModel:
        """The planner's cost model (the config's, or one built from the HF model's config);
        with ``calibration="online"``, the most recently refitted one.

        Raises:
            RuntimeError: before ``setup`` found the model.
        """
        if self._skrull_cost_model is None:
            raise RuntimeError(
                f"{type(self).__name__}.cost_model is known only after setup found the Hugging "
                "Face model; pass SkrullStrategy(cost_model=...) to fix it earlier."
            )
        if self._calibration is not None:
            return self._calibration.latest
        return self._skrull_cost_model

    @property
    def cost_model_schedule(self) -> CostModelSchedule | None:
        """Which cost model plans which training batch (``None`` with ``calibration="off"``)."""
        return None if self._calibration is None else self._calibration.schedule

    @property
    def _attached_module(self) -> pl.LightningModule:
        """The LightningModule the Trainer attached.

        Raises:
            RuntimeError: no LightningModule is attached yet.
        """
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                f"{type(self).__name__} has no LightningModule yet; it is attached by "
                "trainer.fit / validate / test before any step runs."
            )
        return module

    # ------------------------------------------------------------------ set-up
    def _build_parallel_layout(self) -> None:
        self._skrull_layout = build_process_groups(self._skrull_config.cp_size)

    def _accumulation_message(self, factor: int) -> str:
        return (
            f"Trainer(accumulate_grad_batches={factor}) is not supported by "
            f"{type(self).__name__}: one global batch is one optimizer step and its "
            "micro-batches are already accumulated. Set SkrullDataModule(global_batch_size=...) "
            "to the number of sequences per step instead."
        )

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse Trainer settings that would silently change the math."""
        accelerator = trainer.accelerator
        device_type = self.root_device.type
        if device_type not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"{type(self).__name__} runs on {SUPPORTED_ACCELERATORS} devices, but the Trainer "
                f"uses {type(accelerator).__name__} ({device_type}); pass accelerator='cpu' or "
                "'gpu'."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(self._accumulation_message(trainer.accumulate_grad_batches))
        callbacks = cast(list[Any], getattr(trainer, "callbacks", []))
        # Tuner.lr_find fits with this callback, whose curve must be the global loss, not this
        # rank's share of it; read here, at setup: while it searches, the finder swaps the
        # Trainer's callbacks for its own _LRCallback
        self._global_loss_out = any(isinstance(c, LearningRateFinder) for c in callbacks)
        for callback in callbacks:
            if not isinstance(callback, GradientAccumulationScheduler):
                continue
            scheduling: dict[int, int] = callback.scheduling
            if any(factor != 1 for factor in scheduling.values()):
                raise ValueError(
                    f"GradientAccumulationScheduler(scheduling={scheduling}) would set "
                    "Trainer.accumulate_grad_batches above 1 in a later epoch. "
                    + self._accumulation_message(max(scheduling.values()))
                    + " To grow the batch during training, use a new fit with a larger "
                    "global_batch_size."
                )
        config = self._skrull_config
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
        self._refuse_model_sharded_elsewhere(module)
        if self.weight_averaging_refusal is not None:
            refuse_weight_averaging(trainer, type(self).__name__, self.weight_averaging_refusal)
        else:
            refuse_batch_norm_update(trainer, module, type(self).__name__)
        if self.compile_refusal is not None:
            refuse_compiled(module, type(self).__name__, self.compile_refusal)
        _refuse_metrics_synced_on_step(module)
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} needs automatic optimization: it runs the training_step "
                "once per micro-batch and owns the backward of each. Remove "
                "`self.automatic_optimization = False` from the LightningModule."
            )

    def _own_sharded_model(self) -> torch.nn.Module | None:
        """The model this strategy sharded in an earlier set-up (``SkrullFSDPStrategy``), which
        it may set up again (validate after fit by the same Trainer); ``None`` here."""
        return None

    def _refuse_model_sharded_elsewhere(self, module: pl.LightningModule) -> None:
        """Refuse a LightningModule whose model FSDP2 sharded before, unless this strategy did.

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
        own = self._own_sharded_model()
        if own is not None and any(sub is own for sub in module.modules()):
            return
        sharded = [(n, m) for n, m in module.named_modules() if isinstance(m, FSDPModule)]
        if not sharded:
            return
        name, sub = sharded[0]
        shown = next(c for c in type(sub).__mro__ if not issubclass(c, FSDPModule)).__name__
        strategy = type(self).__name__
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

    def _prepare_hf_model(self) -> None:
        """Find the HF model in the LightningModule and switch it to Skrull attention."""
        config = self._skrull_config
        module = self._attached_module
        hf_model = find_hf_model(module, attribute=config.model_attribute)
        self._hf_model = hf_model
        longest = None
        if isinstance(config.bucket_size, int):
            longest = config.cp_size * config.bucket_size
        prepare_model(
            hf_model,
            backend=config.attention_backend,
            max_sequence_length=longest,
            chunked_loss=config.chunked_loss,
            loss_kernel=config.loss_kernel,
        )
        check_checkpointing_gradients(hf_model)
        if self._skrull_config.cost_model is not None:
            self._skrull_cost_model = self._skrull_config.cost_model
        else:
            self._skrull_cost_model = CostModel.from_hf_config(text_config(hf_model.config))

    # ------------------------------------------------------------------ steps
    def _as_rank_batch(self, batch: Any, hook: str) -> tuple[RankBatch, PlanStats | None]:
        """``(rank batch, plan statistics or None)`` of a loader batch, or a clear TypeError."""
        if isinstance(batch, SkrullBatch):
            return batch.rank_batch, batch.stats
        if isinstance(batch, RankBatch):
            return batch, None
        raise TypeError(
            f"{type(self).__name__}.{hook} got a {type(batch).__name__} batch; it needs this "
            "rank's micro-batches of a global batch. Feed the Trainer a "
            "lightning_skrull.SkrullDataModule (or a loader that yields RankBatch objects from "
            "lightning_skrull.data.collate.collate_rank)."
        )

    def _refuse_image_tokens(self, batch: Any) -> None:
        """Refuse a vision-language model's image token in a batch still on the host, once per
        batch (:func:`~lightning_skrull.models.multimodal.refuse_image_token`): the model's
        forward pre-hook reads no tensor values, so the check costs no device sync."""
        hf_model = self._hf_model
        if hf_model is None or not isinstance(batch, (SkrullBatch, RankBatch)):
            return  # a batch of another type is refused by the step itself
        rank_batch = batch.rank_batch if isinstance(batch, SkrullBatch) else batch
        for i, mb in enumerate(rank_batch.micro_batches):
            where = f"micro-batch {i} (samples {list(mb.sample_indices)}) of this rank's batch"
            refuse_image_token(mb.inputs["input_ids"], hf_model.config, where)

    def _micro_batch_context(self, mb: MicroBatch) -> AbstractContextManager[Any]:
        return micro_batch_context(
            mb, self.parallel_layout.cp_group, self._skrull_config.attention_backend
        )

    def _call_module_step(
        self, hook: str, mb: MicroBatch, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the LightningModule's ``hook`` on one micro-batch (inside its context)."""
        module = self._attached_module
        model = self.model
        try:
            if hook == "training_step" and model is not None and model is not module:
                # through the wrapper's forward, as Lightning does: DDP prepares its reducer there
                redirect = self._forward_redirection
                return redirect(model, module, hook, mb.inputs, *args, **kwargs)
            return getattr(module, hook)(mb.inputs, *args, **kwargs)
        except (TypeError, AttributeError) as error:
            if self._hf_model is not None:
                note_missing_logits(error, self._hf_model)  # logits=None under the chunked loss
            raise

    def _check_custom_loss(self, loss: Tensor, logs: StepLogs) -> None:
        """In the first training step of a fit, warn once (rank zero) when a micro-batch's loss
        is not known to follow the normalisation rule: neither the model's loss nor a
        ``token_mean_loss`` value, nor exactly equal to one (docs/loss.md, custom losses)."""
        if self._check_loss_rule and self.is_global_zero and not logs.follows_loss_rule(loss):
            self._check_loss_rule = False
            warnings.warn(CUSTOM_LOSS_MESSAGE, CustomLossWarning, stacklevel=2)

    def _refuse_out_of_step(self) -> None:
        """Refuse anything with collectives after this rank's collectives fell out of step with
        the other ranks' (a ``generate`` call that raised in the middle and was caught)."""
        if self._out_of_step is not None:
            raise RuntimeError(self._out_of_step)

    def _check_plan(self, rank_batch: RankBatch) -> None:
        self._refuse_out_of_step()  # before the step's first collective
        if not self._skrull_config.verify_plans or rank_batch.world_size == 1:
            return
        device = self.root_device
        check_same_plan(
            rank_batch.plan,
            device,
            self.parallel_layout.world_group,
            fingerprint=rank_batch.fingerprint,
        )

    def _measure_bucket_size(self) -> None:
        """Resolve ``bucket_size="auto"`` from probe steps on this device (CUDA only).

        Every rank probes (its CP group together), fits ``peak = alpha * tokens + beta`` and
        chooses a bucket; the smallest over the world is kept, so every rank plans alike.
        """
        config = self._skrull_config
        layout = self.parallel_layout
        device = self.root_device
        module = self._attached_module
        hf_model = find_hf_model(module, attribute=config.model_attribute)
        optimizers = self.optimizers
        precision: Precision = self.precision_plugin
        probe = ProbeStep(
            hf_model,
            optimizers[0] if optimizers else None,
            cp_rank=layout.cp_rank,
            cp_size=layout.cp_size,
            cp_group=layout.cp_group,
            backend=config.attention_backend,
            device=device,
            vocab_size=int(text_config(hf_model.config).vocab_size),
            autocast=precision.train_step_context,
        )
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        capacity = free + torch.cuda.memory_reserved(device)
        try:
            bucket, fit = auto_bucket_size(probe, capacity)
        finally:
            probe.restore()
            torch.cuda.empty_cache()
        chosen = torch.tensor([bucket], dtype=torch.int64, device=device)
        if layout.world_size > 1:
            dist.all_reduce(chosen, op=dist.ReduceOp.MIN, group=layout.world_group)
        bucket = int(chosen)
        self._memory_fit = fit
        self._skrull_config = dataclasses.replace(config, bucket_size=bucket)
        message = describe_fit(fit, bucket, capacity, AUTO_PROBE_TOKENS)
        if layout.rank == 0:
            log.info(message)
        if fit.max_relative_error > NONLINEAR_FIT_ERROR and layout.rank == 0:
            log.warning(
                "bucket_size='auto': the linear memory fit is off by %.1f%% at a probe point "
                "(more than %.0f%%): memory grows faster than linearly in tokens, so the chosen "
                "bucket may not fit. Give bucket_size explicitly (margin %.0f%%).",
                100 * fit.max_relative_error,
                100 * NONLINEAR_FIT_ERROR,
                100 * AUTO_SAFETY_MARGIN,
            )

    @property
    def memory_fit(self) -> MemoryFit | None:
        """The fitted memory model of ``bucket_size="auto"`` (``None`` before setup or when
        the bucket was given)."""
        return self._memory_fit

    @staticmethod
    def _loss_of(output: Any, hook: str, index: int) -> Tensor | None:
        if output is None:
            return None
        if isinstance(output, Tensor):
            return output
        if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
            return output["loss"]
        if hook == "training_step":
            raise TypeError(
                f"training_step returned {type(output).__name__} for micro-batch {index}; return "
                "the loss tensor (or a dict with a 'loss' tensor)."
            )
        return None

    def _earlier_micro_batch_sync_context(self) -> AbstractContextManager[Any]:
        """Context for micro-batches ``0..n-2``: no gradient sync (DDP ``no_sync``)."""
        return nullcontext()

    def _before_last_micro_batch(self) -> None:
        """Called before the last micro-batch's forward (whose backward syncs)."""

    def _earlier_micro_batch_backward(self, loss: Tensor) -> None:
        """Backward of an earlier micro-batch through the precision plugin, without hooks.

        Lightning's ``on_before_backward`` / ``on_after_backward`` belong to the step: they run
        once, around the last micro-batch's backward, which Lightning runs with the step's loss
        (the sum of the shares) and after which the step's whole gradient is in place. So this
        backward skips the plugin's ``pre_backward`` / ``post_backward`` (which call them) and
        applies only what ``pre_backward`` does to the tensor: the AMP loss scale (16-mixed).
        """
        module = self._attached_module
        precision: Precision = self.precision_plugin
        optimizer = self.optimizers[0] if self.optimizers else None
        scaler = getattr(precision, "scaler", None)
        tensor = scaler.scale(loss) if scaler is not None else loss
        precision.backward(tensor, module, optimizer)

    def _stash_gradients(self) -> None:
        """Keep the earlier micro-batches' gradients away from Lightning's ``zero_grad``.

        Lightning's closure calls ``optimizer.zero_grad()`` after the training step and before
        the backward it runs itself; the stash moves the accumulated ``.grad`` tensors aside
        (no copy) and :meth:`backward` puts them back before the last micro-batch's backward.
        """
        module = self._attached_module
        self._stashed_grads = []
        for p in module.parameters():
            if p.grad is not None:
                self._stashed_grads.append((p, p.grad))
                p.grad = None

    def _restore_gradients(self) -> None:
        for p, grad in self._stashed_grads:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self._stashed_grads = []

    def _clear_gradients(self) -> None:
        module = self._attached_module
        for p in module.parameters():
            p.grad = None

    def _close_last_context(self) -> None:
        if self._last_context is not None:
            context, self._last_context = self._last_context, None
            context.close()

    def _skrull_training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.accumulate_grad_batches != 1:  # set after setup
            raise ValueError(self._accumulation_message(trainer.accumulate_grad_batches))
        self._step_start = time.perf_counter()
        self._close_last_context()
        self._stashed_grads = []
        if self._trainable is not None and (change := self._trainable.change()) is not None:
            if self._hf_model is not None:  # embeddings frozen now: the setup's check again
                check_checkpointing_gradients(self._hf_model)
            self._follow_trainable_change(change)
        rank_batch, stats = self._as_rank_batch(args[0], "training_step")
        timer = None
        if self._calibration is not None:
            self._calibration.begin_step(args[0])
            timer = self._calibration.timer
        self._check_plan(rank_batch)
        rest = args[1:]
        micro_batches = rank_batch.micro_batches
        if not micro_batches:
            raise RuntimeError(
                "this rank got no micro-batch for the step; every rank must run at least one "
                "forward and backward (the data module pads with an empty micro-batch)."
            )
        precision: Precision = self.precision_plugin
        earlier: list[Tensor] = []
        outputs: list[Any] = []
        last_index = len(micro_batches) - 1
        logs = self._open_step_logs(rank_batch)
        try:
            with precision.train_step_context():
                if earlier_count := last_index:
                    # start from clean gradients: Lightning zeroes only after the training step
                    self._clear_gradients()
                for i in range(earlier_count):
                    mb = micro_batches[i]
                    logs.start_micro_batch(_supervised_tokens(mb))
                    if timer is not None:
                        timer.start()
                    with self._earlier_micro_batch_sync_context(), self._micro_batch_context(mb):
                        output = self._call_module_step("training_step", mb, rest, kwargs)
                        loss = self._required_loss(output, i)
                        self._check_custom_loss(loss, logs)
                        self._earlier_micro_batch_backward(loss)
                    if timer is not None:
                        timer.stop()
                    earlier.append(loss.detach())
                    outputs.append(recursive_detach(output))
                if earlier:
                    self._stash_gradients()
                self._before_last_micro_batch()
                # the last micro-batch's context stays set until Lightning's backward has run
                # (activation checkpointing recomputes attention there)
                self._last_context = ExitStack()
                self._last_context.enter_context(self._micro_batch_context(micro_batches[-1]))
                logs.start_micro_batch(_supervised_tokens(micro_batches[-1]))
                if timer is not None and self._time_last_micro_batch:
                    timer.start()  # its end: the last gradient hook of Lightning's backward
                output = self._call_module_step("training_step", micro_batches[-1], rest, kwargs)
                last = self._required_loss(output, last_index)
                self._check_custom_loss(last, logs)
        finally:
            self._check_loss_rule = False  # the first step tells
            self._close_step_logs()
        logs.flush()
        # gradient flows through the last micro-batch only; the value is the rank's whole share
        share = last + torch.stack(earlier).sum() if earlier else last
        self._log_step(rank_batch, stats, share.detach(), "train", logs.names)
        if self._global_loss_out and self.world_size > 1:
            # the same gradient, the value of the global loss: the learning-rate finder reads
            # the loss of each step from the returned value
            share = share + (self.reduce(share.detach(), reduce_op="mean") - share.detach())
        if isinstance(output, dict):
            combined = combine_outputs([*outputs, recursive_detach(output)], logs.is_model_loss)
            return {**combined, "loss": share}
        return share

    def _required_loss(self, output: Any, index: int) -> Tensor:
        loss = self._loss_of(output, "training_step", index)
        if loss is None:
            raise RuntimeError(
                f"training_step returned None for micro-batch {index}; skipping part of a global "
                "batch is not supported: every rank must run the same optimizer step."
            )
        return loss

    def _skrull_eval_step(self, hook: str, stage: str, args: tuple[Any, ...], kwargs: Any) -> Any:
        rank_batch, stats = self._as_rank_batch(args[0], hook)
        self._check_plan(rank_batch)
        rest = args[1:]
        precision: Precision = self.precision_plugin
        context = (
            precision.val_step_context() if stage == "validation" else precision.test_step_context()
        )
        losses: list[Tensor] = []
        outputs: list[Any] = []
        logs = self._open_step_logs(rank_batch)
        try:
            with context:
                for i, mb in enumerate(rank_batch.micro_batches):
                    logs.start_micro_batch(_supervised_tokens(mb))
                    with self._micro_batch_context(mb):
                        output = self._call_module_step(hook, mb, rest, kwargs)
                    outputs.append(output)
                    loss = self._loss_of(output, hook, i)
                    if loss is not None:
                        losses.append(loss.detach())
        finally:
            self._close_step_logs()
        logs.flush()
        if losses and len(losses) == len(rank_batch.micro_batches):
            share = torch.stack(losses).sum()
            name = getattr(args[0], "dataset_name", None)
            self._log_step(rank_batch, stats, share, stage, logs.names, dataset_name=name)
        return combine_outputs(outputs, logs.is_model_loss)

    # ------------------------------------------------------------------ generation
    @contextmanager
    def generating(self) -> Iterator[PreTrainedModel]:
        """Generate from a hook or callback mid-run: ``with trainer.strategy.generating() as
        model: model.generate(...)``.

        Inside the block the Hugging Face model runs transformers' attention with a KV cache,
        in eval mode, under ``torch.no_grad`` and in the precision of the validation step
        (autocast under ``"bf16-mixed"`` for DDP; FSDP2's and DeepSpeed's bf16 parameters as
        they are); on exit the Skrull attention, the training flags and everything else
        :func:`~lightning_skrull.models.plain_attention` changed are back, so the next step
        trains as if the block had not run. The yielded model is the inner model (not the DDP
        or DeepSpeed wrapper). Under DDP and ZeRO-2 any subset of ranks may generate (rank 0
        alone, say); under FSDP every rank must enter the block and call ``generate`` (and the
        model itself) the same number of times (``synced_gpus=True`` is passed for you, so the
        numbers of new tokens and the prompts may differ between ranks; a rank entering alone
        and ranks calling the model different numbers of times are refused, see
        :meth:`SkrullFSDPStrategy.generating`).

        Raises:
            RuntimeError: before setup found the model, or inside a step's micro-batches.
        """
        if self._in_micro_batches:
            raise RuntimeError(
                f"{type(self).__name__}.generating() was entered inside a training/validation/"
                "test step, which runs once per micro-batch; generate from on_train_batch_end, "
                "on_validation_epoch_end or another hook that runs once per step or epoch."
            )
        model = self._hf_model
        if model is None:
            raise RuntimeError(
                f"{type(self).__name__}.generating() needs the model the Trainer's setup "
                "prepares; call it from a hook during trainer.fit / validate / test."
            )
        precision: Precision = self.precision_plugin
        with plain_attention(model) as hf_model, precision.val_step_context():
            yield hf_model

    # ------------------------------------------------------------------ saving
    def save_pretrained(self, directory: str | Path, *, dtype: torch.dtype | None = None) -> None:
        """Write the trained model in Hugging Face format, loadable by ``from_pretrained``.

        A collective: call it on every rank (e.g. after ``trainer.fit``); global rank 0 writes
        ``config.json``, ``generation_config.json`` and the safetensors files into
        ``directory``, then every rank waits for it. ``config.architectures`` names the model's
        own class (not DDP's, DeepSpeed's or FSDP's wrapper) and ``config.dtype`` the dtype of
        the written weights (what ``from_pretrained(directory, dtype="auto")`` loads them in);
        ``AutoModelForCausalLM.from_pretrained(directory)`` loads the model on transformers'
        default attention, without this package. When the
        LightningModule's model is a peft ``PeftModel`` (LoRA), the adapter is written instead,
        in peft's format (``adapter_config.json`` and ``adapter_model.safetensors``, loadable
        with ``PeftModel.from_pretrained(base_model, directory)``).

        What is written is what the optimizer stepped: the model's own parameters under
        :class:`~lightning_skrull.SkrullStrategy`; under
        :class:`~lightning_skrull.SkrullZero2Strategy` the float32 master weights gathered from
        DeepSpeed's optimizer partitions (the model's parameters are their bf16 copies under
        ``"bf16-mixed"``/``"bf16-true"``); under :class:`~lightning_skrull.SkrullFSDPStrategy`
        the gathered shards. Parameters that do not train are written as the model holds them.

        Args:
            directory: the folder to write (created if missing).
            dtype: cast every floating-point weight to it (``torch.bfloat16`` for a checkpoint
                half the size of a float32 one); ``None`` writes each in the dtype it trained in.

        Raises:
            RuntimeError: before a Trainer's setup found the model, or inside a step's
                micro-batches.
            ValueError: ``dtype`` is not a floating-point ``torch.dtype``.
        """
        check_save_dtype(dtype)
        self._refuse_in_micro_batches("save_pretrained")
        hf_model = self._hf_model
        if hf_model is None:
            raise RuntimeError(
                f"{type(self).__name__}.save_pretrained needs the model the Trainer's setup "
                "prepares; call it after trainer.fit (or from a hook during it)."
            )
        state = self._trained_state_dict()
        if self.global_rank == 0:
            write_pretrained(self._attached_module, hf_model, state, directory, dtype=dtype)
        self.barrier()

    def _trained_state_dict(self) -> dict[str, Tensor]:
        """The Hugging Face model's full state dict as trained, on CPU, on global rank 0 (an
        empty dict elsewhere). A collective where the strategy gathers it (ZeRO-2, FSDP)."""
        hf_model = self._hf_model
        assert hf_model is not None
        if self.global_rank != 0:
            return {}
        return cpu_state_dict(hf_model)

    # ------------------------------------------------------------------ user collectives
    # ``reduce``, ``broadcast`` and ``barrier`` are abstract in ParallelStrategy, the mixin's
    # base; at run time ``super()`` reaches the concrete Lightning strategy the mixin is put in
    # front of (DDPStrategy or DeepSpeedStrategy), which mypy cannot see (safe-super).
    def _open_step_logs(self, rank_batch: RankBatch) -> StepLogs:
        """Stand in for the module's ``self.log`` while this step's micro-batches run, note the
        model's loss of each micro-batch, and refuse collectives from user code meanwhile."""
        module = self._attached_module
        logs = StepLogs(
            module.log,
            world_size=rank_batch.world_size,
            global_tokens=rank_batch.num_supervised_tokens,
        )

        def note_loss(_: torch.nn.Module, __: Any, output: Any) -> None:
            loss = getattr(output, "loss", None)
            if isinstance(loss, Tensor):
                logs.add_model_loss(loss)

        model = self._hf_model
        self._loss_hook = None if model is None else model.register_forward_hook(note_loss)
        self._token_loss_hook = observe_token_mean_losses(logs.add_model_loss)
        # an instance attribute shadows the method until closed
        module.__dict__["log"] = logs.record
        self._in_micro_batches = True
        return logs

    def _close_step_logs(self) -> None:
        self._in_micro_batches = False
        for hook in (self._loss_hook, self._token_loss_hook):
            if hook is not None:
                hook.remove()
        self._loss_hook = self._token_loss_hook = None
        module = self.lightning_module
        if module is not None and "log" in module.__dict__:
            del module.__dict__["log"]

    def _refuse_in_micro_batches(self, collective: str) -> None:
        if self._in_micro_batches:
            raise RuntimeError(
                f"{collective} was called while {type(self).__name__} runs a step's micro-batches "
                "(the LightningModule's training/validation/test_step runs once per "
                "micro-batch, and DP ranks run different numbers of them), so the collective "
                "would not pair up across ranks and the run would hang. Log with "
                "self.log(..., sync_dist=True) instead (synced once per step), or gather in "
                "on_train_batch_end / on_validation_batch_end / an on_*_epoch_end hook."
            )

    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        self._refuse_in_micro_batches("all_gather (self.all_gather)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        self._refuse_in_micro_batches("strategy.reduce")
        return super().reduce(tensor, *args, **kwargs)  # type: ignore[safe-super]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self._refuse_in_micro_batches("strategy.broadcast")
        return super().broadcast(obj, src)  # type: ignore[safe-super]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._refuse_in_micro_batches("strategy.barrier")
        super().barrier(*args, **kwargs)  # type: ignore[safe-super]

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self._check_trainer(trainer)
        self._prepare_hf_model()
        self._train_mode_for_fit(trainer)
        self._refuse_meta_tensors()
        super().setup(trainer)
        check_averaged_pairs(trainer, self._attached_module, type(self).__name__)
        if self._skrull_config.bucket_size == AUTO_BUCKET:
            self._measure_bucket_size()
        self._setup_calibration(trainer)
        self._setup_stop_agreement(trainer)
        self._watch_trainable_parameters(trainer)

    @override
    def batch_to_device(
        self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0
    ) -> Any:
        self._refuse_image_tokens(batch)  # on the host, before the move
        return super().batch_to_device(batch, device, dataloader_idx)

    def _train_mode_for_fit(self, trainer: pl.Trainer) -> None:
        """When fitting, put a model that ``from_pretrained`` left in eval mode in training mode
        (:func:`~lightning_skrull.models.modes.train_mode_for_fit`)."""
        hf_model = self._hf_model
        if trainer.state.fn != "fit" or hf_model is None:
            return
        if train_mode_for_fit(hf_model):
            rank_zero_info(
                f"{type(self).__name__}: {type(hf_model).__name__} was in eval mode (as "
                "from_pretrained returns it); it trains in training mode, so activation "
                "checkpointing and everything else transformers does only in training apply."
            )

    def _refuse_meta_tensors(self) -> None:
        """Refuse, on every rank (one all-reduce), a model that some rank built on the meta
        device: this strategy keeps a full replica per rank and has nothing to fill it from."""
        hf_model = self._hf_model
        assert hf_model is not None
        meta = agree_on_meta_tensors(self._attached_module, hf_model, self.root_device)
        if meta.anywhere:
            raise ValueError(
                f"{type(self).__name__} keeps a full copy of the model on every rank, but some "
                f"rank built it on the meta device{meta.on_this_rank()}, without weights (as "
                "from_pretrained_on_rank_zero does on ranks other than 0). Use "
                "SkrullFSDPStrategy, which shards the model and fills every rank from rank 0's "
                "weights, or load the weights on every rank (AutoModelForCausalLM."
                "from_pretrained; SkrullCausalLM(load_on_rank_zero=False))."
            )

    def _setup_calibration(self, trainer: pl.Trainer) -> None:
        """Start online calibration when fitting with ``calibration="online"`` (last in setup,
        after the model and the bucket are final); apply a state restored from a checkpoint."""
        if self._skrull_config.calibration == "online" and trainer.state.fn == "fit":
            self._calibration = StepCalibration(
                self.cost_model, self.parallel_layout, self.root_device
            )
            self._calibration.attach(self._attached_module)
            if self._calibration_state is not None:
                self._calibration.load_state_dict(self._calibration_state)

    def _setup_stop_agreement(self, trainer: pl.Trainer) -> None:
        """When fitting on several ranks, make them agree on ``trainer.should_stop``
        (:class:`~lightning_skrull.strategies.stopping.StopAgreement`)."""
        if trainer.state.fn == "fit" and self.world_size > 1:
            self._stop_agreement = StopAgreement(
                trainer, self.root_device, type(self).__name__, self._refuse_out_of_step
            )
            self._stop_agreement.attach()

    def _watch_trainable_parameters(self, trainer: pl.Trainer) -> None:
        """When fitting, note which parameters are trainable now that the module is set up
        (:class:`~lightning_skrull.strategies.trainable.TrainableParameters`); each training
        step starts by following what changed since (:meth:`_follow_trainable_change`)."""
        fitting = trainer.state.fn == "fit"
        self._trainable = TrainableParameters(self._attached_module) if fitting else None

    def _follow_trainable_change(self, change: TrainableChange) -> None:
        """Make the gradient synchronisation follow parameters frozen or unfrozen since the
        setup or the last step (``BaseFinetuning`` callbacks, ``requires_grad_`` in a hook),
        before the step's first forward; or raise where the strategy cannot."""

    @override
    def on_validation_end(self) -> None:
        # after the callbacks' and the module's on_validation_end and epoch-end hooks
        if self._stop_agreement is not None:
            self._stop_agreement.agree()
        super().on_validation_end()

    @override
    def on_train_start(self) -> None:
        self._check_loss_rule = True  # checked in the first training step of each fit
        self._refuse_rounded_masters()
        super().on_train_start()

    def _refuse_rounded_masters(self) -> None:
        """Refuse a fit, without a checkpoint to resume, of a model whose float32 master weights
        an earlier fit left in its optimizer (after the checkpoint, if any, is restored; every
        rank alike, as every rank ran the same fits); note this fit's when it keeps them apart.

        Raises:
            ValueError: the model's parameters hold 16-bit copies of an earlier fit's masters.
        """
        hf_model = self._hf_model
        if hf_model is None:
            return
        trainer = self._attached_module.trainer
        earlier = MASTERS_LEFT_IN_AN_OPTIMIZER.get(hf_model)
        if earlier is not None and trainer.ckpt_path is None:
            raise ValueError(
                f"{type(self).__name__}: this model was trained by an earlier fit of "
                f"{earlier} in this process. DeepSpeed kept its float32 master weights in that "
                "fit's optimizer and the model's parameters hold their 16-bit copies, so this "
                "fit would start from weights rounded to 16 bits (up to 2^-8 of each, in bf16). "
                "Resume the earlier fit from one of its "
                "checkpoints instead, which hold the masters (trainer.fit(module, data, "
                "ckpt_path=...) with a larger max_epochs or max_steps), or write the trained "
                "model with trainer.strategy.save_pretrained(path) after that fit and train a "
                "module loaded from it."
            )
        precision = str(getattr(self.precision_plugin, "precision", ""))
        if precision in self.masters_apart_in:
            MASTERS_LEFT_IN_AN_OPTIMIZER[hf_model] = f"{type(self).__name__} in {precision!r}"

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._skrull_training_step(args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._skrull_eval_step("validation_step", "validation", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._skrull_eval_step("test_step", "test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"{type(self).__name__} does not support trainer.predict: generation needs a KV "
            "cache, which context-parallel attention does not keep. Generate from a hook "
            "inside `with trainer.strategy.generating() as model:` (e.g. in "
            "on_validation_epoch_end), or predict with a plain strategy (e.g. 'ddp') on an "
            "unpatched model."
        )

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        self._restore_gradients()
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self._close_last_context()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._log_throughput()
        if self._calibration is not None:
            self._calibration.end_step()  # outside the micro-batches: may all-gather
            if self._logs_stats_this_step():  # a refit's metrics wait for a logging step
                self._log_values(self._calibration.take_metrics())
        return output

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        self._refuse_out_of_step()
        if self._calibration is not None:
            checkpoint[CHECKPOINT_KEY] = self._calibration.state_dict()
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        refuse_other_kind(type(self).__name__, checkpoint_path, self.checkpoint_kinds)
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self._skrull_config.calibration == "online":
            self._calibration_state = state  # applied at setup (or now, when set up already)
            if self._calibration is not None:
                self._calibration.load_state_dict(state)
        return checkpoint

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._close_last_context()
        self._stashed_grads = []
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        if self._calibration is not None:
            self._calibration.detach()
        if self._stop_agreement is not None:
            self._stop_agreement.detach()
            self._stop_agreement = None
        self._close_last_context()
        self._stashed_grads = []
        module = self.lightning_module
        if module is not None and meta_tensor_names(module):
            # a model refused at setup for its meta tensors cannot move to the CPU (they hold no
            # data): let go of it, so Lightning's teardown does not hide the refusal
            self.model = None
            self._lightning_module = None
        super().teardown()

    # ------------------------------------------------------------------ logging
    def _log_step(
        self,
        rank_batch: RankBatch,
        stats: PlanStats | None,
        share: Tensor,
        stage: str,
        user_names: tuple[str, ...] = (),
        *,
        dataset_name: str | None = None,
    ) -> None:
        """Log the exact loss of the global batch and, in training, the plan statistics.

        ``share`` is this rank's sum of micro-batch losses, i.e. its token-loss sum over
        ``T / W``; its mean over the ``W`` ranks is the global token mean. Logged with
        ``batch_size = T``, Lightning's epoch-level weighted mean over batches and ranks is the
        token mean over the whole epoch. A name the module logged itself in this step
        (``user_names``) is left to the module's value.

        A batch of a named validation or test set (``dataset_name``) logs ``val_loss/<name>``
        (``test_loss/<name>``) without Lightning's ``/dataloader_idx_N``; an unnamed one logs
        ``val_loss``, to which Lightning adds ``/dataloader_idx_N`` under several loaders.
        """
        if not self._skrull_config.log_stats:
            return
        module = self.lightning_module
        if module is None or module._trainer is None or module._trainer.barebones:
            return
        on_step = stage == "train"
        key = LOSS_KEYS[stage] if dataset_name is None else f"{LOSS_KEYS[stage]}/{dataset_name}"
        if key in user_names:
            return
        module.log(
            key,
            share.float(),
            on_step=on_step,
            on_epoch=not on_step,
            prog_bar=True,
            # one process: its share is the loss; a step value needs no collective, an epoch
            # value is marked synced all the same (Lightning warns about unsynced epoch values
            # whenever a process group exists, and syncs once at the epoch's end)
            sync_dist=self.world_size > 1 or not on_step,
            add_dataloader_idx=dataset_name is None,
            batch_size=max(rank_batch.num_supervised_tokens, 1),
        )
        if stage != "train" or stats is None:
            return
        self._step_tokens = stats.num_tokens
        values = {
            "skrull/supervised_tokens": float(stats.num_supervised_tokens),
            "skrull/tokens": float(stats.num_tokens),
            "skrull/distributed_share": stats.distributed_share,
            "skrull/plan_imbalance": stats.imbalance,
            "skrull/est_step_s": stats.estimated_seconds,
            "skrull/micro_batches_max": float(stats.max_micro_batches),
            "skrull/micro_batches_min": float(stats.min_micro_batches),
            "skrull/micro_batches_rank": float(rank_batch.num_planned_micro_batches),
        }
        self._log_values(values)

    def _log_values(self, values: dict[str, float]) -> None:
        """Log per-step values (plan statistics, calibration) unless ``log_stats`` is off.

        Only on the steps whose on-step values Lightning writes to its loggers (every
        ``log_every_n_steps``, and under ``fast_dev_run``), the rule Lightning's own
        ``LearningRateMonitor`` follows: the loggers see the same values as when logging every
        step, and the other steps skip about 0.5 ms of ``self.log`` per value, which a step of
        a few short sequences notices (docs/benchmarks.md, per-sequence overhead).
        """
        if not values or not self._logs_stats_this_step():
            return
        module = self.lightning_module
        assert module is not None
        for key, value in values.items():
            module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    def _logs_stats_this_step(self) -> bool:
        """Whether :meth:`_log_values` logs in this training step (see there)."""
        module = self.lightning_module
        if not self._skrull_config.log_stats or module is None:
            return False
        trainer = module._trainer
        if trainer is None or trainer.barebones:
            return False
        fast_dev_run = getattr(trainer, "fast_dev_run", False)  # set by the Trainer's debug flags
        return bool(fast_dev_run) or trainer._logger_connector.should_update_logs

    def _log_throughput(self) -> None:
        if self._step_start is None or not self._skrull_config.log_stats:
            return
        module = self.lightning_module
        elapsed = time.perf_counter() - self._step_start
        self._step_start = None
        if module is None or module._trainer is None or elapsed <= 0 or not self._step_tokens:
            return
        module.log(
            "tokens_per_s",
            self._step_tokens / elapsed,
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            batch_size=1,
        )
