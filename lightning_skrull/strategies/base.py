"""The shared base of the Skrull strategies: one Skrull global batch per optimizer step.

:class:`SkrullStrategyMixin` is put in front of a Lightning data-parallel strategy
(:class:`~lightning_skrull.strategies.ddp.SkrullStrategy`,
:class:`~lightning_skrull.strategies.deepspeed.SkrullZero2Strategy`,
:class:`~lightning_skrull.strategies.fsdp.SkrullFSDPStrategy`): the DP x CP process groups
(CP innermost), the Hugging Face model switched to the ``"skrull"`` attention at setup, and a
``training_step`` that runs the LightningModule's own once per micro-batch of this rank's
batch; only the last micro-batch's backward (Lightning's) syncs the gradients.

The mixin is the list of Lightning hooks; helper objects do the work (as Lightning's
strategies hand theirs to precision plugins): :mod:`.micro_batches` (the step loop),
:mod:`.step_logging`, :mod:`.setup_checks`, :mod:`.trained_model`, :mod:`.step_timing`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_skrull.config import AUTO_BUCKET, SkrullConfig
from lightning_skrull.data.batch import PlanSettings
from lightning_skrull.models.generation import plain_attention
from lightning_skrull.models.loss_kernels import FUSED_KERNEL_MODULES, check_loss_kernel
from lightning_skrull.models.saving import check_save_dtype, cpu_state_dict, write_pretrained
from lightning_skrull.runtime.memory import MemoryFit, measure_auto_bucket
from lightning_skrull.runtime.meta_init import meta_tensor_names
from lightning_skrull.runtime.process_groups import ParallelLayout, build_process_groups
from lightning_skrull.scheduling import CostModel, CostModelSchedule
from lightning_skrull.strategies import setup_checks
from lightning_skrull.strategies.checkpoint_kinds import CheckpointKind, refuse_other_kind
from lightning_skrull.strategies.micro_batches import MicroBatchRunner
from lightning_skrull.strategies.step_logging import StepLogger
from lightning_skrull.strategies.step_timing import OnlineCalibration, StepCalibration
from lightning_skrull.strategies.stopping import StopAgreement
from lightning_skrull.strategies.trainable import TrainableChange, TrainableParameters
from lightning_skrull.strategies.trained_model import (
    log_auto_bucket,
    model_to_generate,
    plan_settings,
    prepare_trained_model,
    probe_step,
    put_in_train_mode,
    require_model,
)
from lightning_skrull.strategies.weight_averaging import check_averaged_pairs

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)


class SkrullStrategyMixin(ParallelStrategy):
    """What every Skrull strategy adds to a Lightning data-parallel strategy.

    The concrete classes mix this in front of a Lightning strategy (``DDPStrategy`` or
    ``DeepSpeedStrategy``) and set the two hooks that differ: how an earlier micro-batch's
    backward is kept from syncing, and whether every DP rank must run the same number of
    micro-batches.
    """

    _skrull_config: SkrullConfig
    _time_last_micro_batch = True
    """Time the last micro-batch for online calibration (its end is the last gradient hook of
    Lightning's backward); a strategy whose hooks cannot mark that end without the DP gradient
    sync leaves it out (its earlier micro-batches are still timed)."""

    masters_apart_in: tuple[str, ...] = ()
    """The precisions in which the optimizer steps float32 masters kept apart from the model's
    16-bit parameters (DeepSpeed's ``bf16`` and ``fp16``); a later fit of the model without a
    checkpoint is refused (:func:`~.setup_checks.refuse_rounded_masters`)."""

    requires_equal_micro_batches: bool = False
    """Whether every DP rank must run the same number of micro-batches per step (ZeRO-2
    reduces gradients in every backward, so it does; DDP syncs only the last)."""

    weight_averaging_refusal: str | None = None
    """Why Lightning's weight-averaging callbacks cannot run under this strategy (refused at
    setup), or ``None`` where they average exactly what one process would."""

    checkpoint_kinds: tuple[CheckpointKind, ...] = ("file",)
    """The checkpoints this strategy reads (:mod:`~lightning_skrull.strategies.checkpoint_kinds`);
    another kind is refused when loaded, naming what wrote it and the fix."""

    compile_refusal: str | None = None
    """Why a compiled model cannot train under this strategy (refused at setup,
    :func:`~.setup_checks.refuse_compiled`), or ``None`` where it trains as the eager one."""

    def _init_skrull(self, config: SkrullConfig) -> None:
        # the name always (a misspelt kernel is refused even while the loss is dense);
        # whether a fused kernel's package is installed only where the chunked loss runs
        check_loss_kernel(
            config.loss_kernel,
            installed=None if config.chunked_loss else tuple(FUSED_KERNEL_MODULES),
        )
        self._skrull_config = config
        self._skrull_layout: ParallelLayout | None = None
        self._skrull_cost_model: CostModel | None = None
        self._memory_fit: MemoryFit | None = None
        self._hf_model: torch.nn.Module | None = None
        self._stop_agreement: StopAgreement | None = None
        self._out_of_step: str | None = None
        self._trainable: TrainableParameters | None = None
        self.calibration = OnlineCalibration(config.calibration == "online")
        self.micro_batches = MicroBatchRunner(self)
        self.step_logger = StepLogger(self)

    @property
    def skrull_config(self) -> SkrullConfig:
        """The strategy's :class:`~lightning_skrull.config.SkrullConfig` (after setup with a
        measured ``bucket_size="auto"``, the measured bucket)."""
        return self._skrull_config

    @property
    def plan_settings(self) -> PlanSettings | None:
        """What the data is planned with: the config with its bucket known and the trained
        model's vocabulary and image token; ``None`` before setup found the model, and while a
        ``bucket_size="auto"`` is not measured yet."""
        return plan_settings(self._skrull_config, self._hf_model)

    @property
    def parallel_layout(self) -> ParallelLayout:
        """This process's place in the DP x CP world and its groups (a RuntimeError before the
        Trainer set up the process group)."""
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
        with ``calibration="online"``, the most recently refitted one (a RuntimeError before
        ``setup`` found the model)."""
        if self._skrull_cost_model is None:
            raise RuntimeError(
                f"{type(self).__name__}.cost_model is known only after setup found the Hugging "
                "Face model; pass SkrullStrategy(cost_model=...) to fix it earlier."
            )
        if self._calibration is not None:
            return self._calibration.latest
        return self._skrull_cost_model

    @property
    def _calibration(self) -> StepCalibration | None:
        return self.calibration.running

    @property
    def cost_model_schedule(self) -> CostModelSchedule | None:
        """Which cost model plans which training batch (``None`` with ``calibration="off"``)."""
        return None if self._calibration is None else self._calibration.schedule

    @property
    def memory_fit(self) -> MemoryFit | None:
        """The fitted memory model of ``bucket_size="auto"`` (``None`` before setup or when
        the bucket was given)."""
        return self._memory_fit

    @property
    def _attached_module(self) -> pl.LightningModule:
        """The LightningModule the Trainer attached (a RuntimeError before)."""
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                f"{type(self).__name__} has no LightningModule yet; it is attached by "
                "trainer.fit / validate / test before any step runs."
            )
        return module

    def _earlier_micro_batch_sync_context(self) -> AbstractContextManager[Any]:
        """Context for micro-batches ``0..n-2``: no gradient sync (DDP ``no_sync``)."""
        return nullcontext()

    def _before_last_micro_batch(self) -> None:
        """Called before the last micro-batch's forward (whose backward syncs)."""

    def _follow_trainable_change(self, change: TrainableChange) -> None:
        """Make the gradient synchronisation follow parameters frozen or unfrozen since the
        setup or the last step (``BaseFinetuning`` callbacks, ``requires_grad_`` in a hook),
        before the step's first forward; or raise where the strategy cannot."""

    def _own_sharded_model(self) -> torch.nn.Module | None:
        """The model this strategy sharded in an earlier set-up (``SkrullFSDPStrategy``), which
        it may set up again (validate after fit by the same Trainer); ``None`` here."""
        return None

    def _trained_state_dict(self) -> dict[str, Tensor]:
        """The Hugging Face model's full state dict as trained, on CPU, on global rank 0 (an
        empty dict elsewhere). A collective where the strategy gathers it (ZeRO-2, FSDP)."""
        assert self._hf_model is not None
        return cpu_state_dict(self._hf_model) if self.global_rank == 0 else {}

    # ------------------------------------------------------------------ set-up
    def _build_parallel_layout(self) -> None:  # right after the default process group exists
        self._skrull_layout = build_process_groups(self._skrull_config.cp_size)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse Trainer settings that would silently change the math
        (:func:`~lightning_skrull.strategies.setup_checks.check_trainer`)."""
        self.micro_batches.note_callbacks(trainer)
        setup_checks.check_trainer(
            trainer,
            self._skrull_config,
            self.root_device,
            strategy=type(self).__name__,
            own_sharded_model=self._own_sharded_model(),
            weight_averaging_refusal=self.weight_averaging_refusal,
            compile_refusal=self.compile_refusal,
        )

    def _prepare_hf_model(self) -> None:
        """Find the HF model in the LightningModule (once per setup: the step, the checks and
        the data module's :attr:`plan_settings` use it) and switch it to Skrull attention."""
        module, config = self._attached_module, self._skrull_config
        self._hf_model, self._skrull_cost_model = prepare_trained_model(module, config)

    def _train_mode_for_fit(self, trainer: pl.Trainer) -> None:
        """When fitting, put a model that ``from_pretrained`` left in eval mode in training mode
        (:func:`~lightning_skrull.models.modes.train_mode_for_fit`)."""
        hf_model = self._hf_model
        if trainer.state.fn != "fit" or hf_model is None:
            return
        put_in_train_mode(hf_model, type(self).__name__)

    def _measure_bucket_size(self) -> None:
        """Resolve ``bucket_size="auto"`` from probe steps on this device (CUDA only,
        :func:`~lightning_skrull.runtime.memory.measure_auto_bucket`): the smallest bucket
        over the world becomes the config's, which :attr:`plan_settings` then publishes."""
        hf_model, precision = self._hf_model, cast(Precision, self.precision_plugin)
        assert hf_model is not None
        optimizer = self.optimizers[0] if self.optimizers else None
        layout, config, device = self.parallel_layout, self._skrull_config, self.root_device
        probe = probe_step(
            hf_model, optimizer, layout, config, device, precision.train_step_context
        )
        measured = measure_auto_bucket(probe, layout.world_group, layout.world_size)
        self._memory_fit = measured.fit
        self._skrull_config = dataclasses.replace(config, bucket_size=measured.bucket_size)
        log_auto_bucket(measured, log, rank=layout.rank)

    def _setup_calibration(self, trainer: pl.Trainer) -> None:
        """Start online calibration when fitting with ``calibration="online"`` (last in setup,
        after the model and the bucket are final); apply a state restored from a checkpoint."""
        if self.calibration.enabled and trainer.state.fn == "fit":
            module = self._attached_module
            self.calibration.start(self.cost_model, self.parallel_layout, self.root_device, module)

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

    def _refuse_out_of_step(self) -> None:
        """Refuse anything with collectives after this rank's collectives fell out of step with
        the other ranks' (a ``generate`` call that raised in the middle and was caught)."""
        if self._out_of_step is not None:
            raise RuntimeError(self._out_of_step)

    # ------------------------------------------------------------------ Lightning hooks
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        module = trainer.lightning_module
        self._check_trainer(trainer)
        self._prepare_hf_model()
        self._train_mode_for_fit(trainer)
        assert self._hf_model is not None
        name = type(self).__name__
        setup_checks.refuse_meta_tensors(module, self._hf_model, self.root_device, strategy=name)
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
        setup_checks.refuse_image_tokens(self._hf_model, batch)  # on the host, before the move
        return super().batch_to_device(batch, device, dataloader_idx)

    @override
    def on_validation_end(self) -> None:
        # after the callbacks' and the module's on_validation_end and epoch-end hooks
        if self._stop_agreement is not None:
            self._stop_agreement.agree()
        super().on_validation_end()

    @override
    def on_train_start(self) -> None:
        self.micro_batches.check_loss_rule = True  # checked in the first training step of a fit
        if (hf_model := self._hf_model) is not None:
            resumes = self._attached_module.trainer.ckpt_path is not None
            precision = str(getattr(self.precision_plugin, "precision", ""))
            name, apart = type(self).__name__, self.masters_apart_in
            setup_checks.refuse_rounded_masters(hf_model, resumes, name, precision, apart)
        super().on_train_start()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.micro_batches.training_step(args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.micro_batches.eval_step("validation_step", "validation", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.micro_batches.eval_step("test_step", "test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        setup_checks.refuse_predict(type(self).__name__)

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        self.micro_batches.restore_gradients()
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        finally:
            self.micro_batches.close_last_context()

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        self.step_logger.log_throughput()
        if self._calibration is not None:
            self._calibration.end_step()  # outside the micro-batches: may all-gather
            if self.step_logger.logs_stats_this_step():  # a refit's metrics wait for logging
                self.step_logger.log_values(self._calibration.take_metrics())
        return output

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        self._refuse_out_of_step()
        self.calibration.save(checkpoint)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        refuse_other_kind(type(self).__name__, checkpoint_path, self.checkpoint_kinds)
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        self.calibration.load(checkpoint)
        return checkpoint

    @override
    def on_exception(self, exception: BaseException) -> None:
        self.micro_batches.reset()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self.calibration.stop()
        if self._stop_agreement is not None:
            self._stop_agreement.detach()
            self._stop_agreement = None
        self.micro_batches.reset()
        module = self.lightning_module
        if module is not None and meta_tensor_names(module):
            # a model refused at setup for its meta tensors cannot move to the CPU (they hold no
            # data): let go of it, so Lightning's teardown does not hide the refusal
            self.model = None
            self._lightning_module = None
        super().teardown()

    # ``reduce``, ``broadcast`` and ``barrier`` are abstract in ParallelStrategy, the mixin's
    # base; at run time ``super()`` reaches the concrete Lightning strategy the mixin is put in
    # front of (DDPStrategy or DeepSpeedStrategy), which mypy cannot see (safe-super).
    @override
    def all_gather(
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        self.step_logger.refuse_collective("all_gather (self.all_gather)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        self.step_logger.refuse_collective("strategy.reduce")
        return super().reduce(tensor, *args, **kwargs)  # type: ignore[safe-super]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.step_logger.refuse_collective("strategy.broadcast")
        return super().broadcast(obj, src)  # type: ignore[safe-super]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self.step_logger.refuse_collective("strategy.barrier")
        super().barrier(*args, **kwargs)  # type: ignore[safe-super]

    # ------------------------------------------------------------------ generation, saving
    @contextmanager
    def generating(self) -> Iterator[PreTrainedModel]:
        """Generate from a hook or callback mid-run: ``with trainer.strategy.generating() as
        model: model.generate(...)`` (docs/models.md, generating during training).

        Inside the block the inner Hugging Face model runs transformers' attention with a KV
        cache, in eval mode, without gradients, in the validation step's precision; on exit
        all :func:`~lightning_skrull.models.plain_attention` changed is back. Under FSDP every
        rank must enter it and call the model alike (:meth:`SkrullFSDPStrategy.generating`).

        Raises:
            RuntimeError: before setup found the model, or inside a step's micro-batches.
        """
        running = self.step_logger.in_micro_batches
        model = model_to_generate(self._hf_model, type(self).__name__, running)
        precision: Precision = self.precision_plugin
        with plain_attention(model) as hf_model, precision.val_step_context():
            yield hf_model

    def save_pretrained(self, directory: str | Path, *, dtype: torch.dtype | None = None) -> None:
        """Write the trained model in Hugging Face format, loadable by ``from_pretrained``
        (docs/models.md, what ``save_pretrained`` writes).

        A collective: call it on every rank (e.g. after ``trainer.fit``); global rank 0 writes
        ``config.json``, ``generation_config.json`` and the safetensors files (a peft model:
        its adapter, in peft's format) into ``directory``, then every rank waits for it. What
        is written is what the optimizer stepped: the model's parameters under
        :class:`~lightning_skrull.SkrullStrategy`, DeepSpeed's float32 masters under
        :class:`~lightning_skrull.SkrullZero2Strategy`, the gathered shards under
        :class:`~lightning_skrull.SkrullFSDPStrategy`.

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
        self.step_logger.refuse_collective("save_pretrained")
        when = "call it after trainer.fit (or from a hook during it)"
        hf_model = require_model(self._hf_model, f"{type(self).__name__}.save_pretrained", when)
        state = self._trained_state_dict()
        if self.global_rank == 0:
            write_pretrained(self._attached_module, hf_model, state, directory, dtype=dtype)
        self.barrier()
