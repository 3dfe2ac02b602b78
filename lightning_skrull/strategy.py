"""Lightning strategies that run one Skrull global batch per optimizer step.

:class:`SkrullStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (gloo on
CPU, NCCL on GPU, launched the way Lightning launches DDP) plus:

- the DP x CP process groups, CP innermost (``cp_rank = rank % cp_size``), built right after
  the default process group exists;
- the Hugging Face model found inside the LightningModule and switched to the ``"skrull"``
  attention before it is wrapped;
- a ``training_step`` that takes this rank's :class:`~lightning_skrull.data.collate.RankBatch`
  (from :class:`~lightning_skrull.data.datamodule.SkrullDataModule`) and runs the
  LightningModule's own ``training_step`` once per micro-batch inside that micro-batch's attention
  context. All micro-batches but the last run forward and backward right there under DDP
  ``no_sync``; the last one's loss goes back to Lightning, whose backward syncs the gradients once. DP ranks
  may have different micro-batch counts: only the last backward communicates.

:class:`SkrullZero2Strategy` (``"skrull_zero2"``, in :mod:`lightning_skrull.zero`) does the same
on DeepSpeed ZeRO-2.
"""

from __future__ import annotations

import inspect
import time
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.memory import recursive_detach
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lightning_skrull.config import AUTO_BUCKET, SkrullConfig
from lightning_skrull.step_logging import StepLogs, combine_outputs

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_skrull.data.collate import MicroBatch, RankBatch
    from lightning_skrull.distributed import ParallelLayout
    from lightning_skrull.memory import MemoryFit
    from lightning_skrull.scheduling.cost_model import CostModel

_NO_FORWARD_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
"""DDP's argument that turns off the per-forward buffer sync (renamed in torch 2.13)."""

SUPPORTED_ACCELERATORS = ("cpu", "cuda")
"""Device types the strategies run on (SDPA attention on CPU, SDPA or FlashAttention varlen on CUDA)."""

LOSS_KEYS = {"train": "train_loss", "validation": "val_loss", "test": "test_loss"}
"""Names under which the strategy logs the exact loss of each stage."""


def _refuse_metrics_synced_on_step(module: torch.nn.Module) -> None:
    """Refuse torchmetrics that sync in every ``forward`` (a collective per micro-batch)."""
    from torchmetrics import Metric

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
    from lightning_skrull.data.collate import IGNORE_INDEX

    return (mb.inputs["shift_labels"] != IGNORE_INDEX).sum()


class SkrullStrategyMixin:
    """What every Skrull strategy adds to a Lightning data-parallel strategy.

    The concrete classes mix this in front of a Lightning strategy (``DDPStrategy`` or
    ``DeepSpeedStrategy``) and set the two hooks that differ: how an earlier micro-batch's
    backward is kept from syncing, and whether every DP rank must run the same number of
    micro-batches.
    """

    _skrull_config: SkrullConfig
    _skrull_layout: ParallelLayout | None
    _skrull_cost_model: CostModel | None
    _stashed_grads: list[tuple[torch.nn.Parameter, Tensor]]
    _step_start: float | None
    _step_tokens: int

    requires_equal_micro_batches: bool = False
    """Whether every DP rank must run the same number of micro-batches per step (ZeRO-2
    reduces gradients in every backward, so it does; DDP syncs only the last)."""

    def _init_skrull(self, config: SkrullConfig) -> None:
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
        self._in_micro_batches = False

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
        """The planner's cost model (the config's, or one built from the HF model's config).

        Raises:
            RuntimeError: before ``setup`` found the model.
        """
        if self._skrull_cost_model is None:
            raise RuntimeError(
                f"{type(self).__name__}.cost_model is known only after setup found the Hugging "
                "Face model; pass SkrullStrategy(cost_model=...) to fix it earlier."
            )
        return self._skrull_cost_model

    # ------------------------------------------------------------------ set-up
    def _build_parallel_layout(self) -> None:
        from lightning_skrull.distributed import build_process_groups

        self._skrull_layout = build_process_groups(self._skrull_config.cp_size)

    def _check_trainer(self, trainer: pl.Trainer) -> None:
        """Refuse Trainer settings that would silently change the math."""
        accelerator = trainer.accelerator
        device_type = self.root_device.type  # type: ignore[attr-defined]
        if device_type not in SUPPORTED_ACCELERATORS:
            raise ValueError(
                f"{type(self).__name__} runs on {SUPPORTED_ACCELERATORS} devices, but the Trainer "
                f"uses {type(accelerator).__name__} ({device_type}); pass accelerator='cpu' or "
                "'gpu'."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) is not "
                f"supported by {type(self).__name__}: one global batch is one optimizer step and "
                "its micro-batches are already accumulated. Set SkrullDataModule("
                "global_batch_size=...) to the number of sequences per step instead."
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
        _refuse_metrics_synced_on_step(module)
        if not module.automatic_optimization:
            raise ValueError(
                f"{type(self).__name__} needs automatic optimization: it runs the training_step "
                "once per micro-batch and owns the backward of each. Remove "
                "`self.automatic_optimization = False` from the LightningModule."
            )

    def _prepare_hf_model(self) -> None:
        """Find the HF model in the LightningModule and switch it to Skrull attention."""
        from lightning_skrull.models.patching import find_hf_model, prepare_model
        from lightning_skrull.scheduling import CostModel

        config = self._skrull_config
        module = self.lightning_module  # type: ignore[attr-defined]
        hf_model = find_hf_model(module, attribute=config.model_attribute)
        self._hf_model = hf_model
        longest = None
        if isinstance(config.bucket_size, int):
            longest = config.cp_size * config.bucket_size
        prepare_model(hf_model, backend=config.attention_backend, max_sequence_length=longest)
        if self._skrull_config.cost_model is not None:
            self._skrull_cost_model = self._skrull_config.cost_model
        else:
            self._skrull_cost_model = CostModel.from_hf_config(hf_model.config)

    # ------------------------------------------------------------------ steps
    def _as_rank_batch(self, batch: Any, hook: str) -> tuple[RankBatch, Any]:
        """``(rank batch, plan statistics or None)`` of a loader batch, or a clear TypeError."""
        from lightning_skrull.data.collate import RankBatch
        from lightning_skrull.data.datamodule import SkrullBatch

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

    def _micro_batch_context(self, mb: MicroBatch) -> AbstractContextManager[Any]:
        from lightning_skrull.engine import micro_batch_context

        return micro_batch_context(
            mb, self.parallel_layout.cp_group, self._skrull_config.attention_backend
        )

    def _call_module_step(
        self, hook: str, mb: MicroBatch, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the LightningModule's ``hook`` on one micro-batch (inside its context)."""
        module = self.lightning_module  # type: ignore[attr-defined]
        model = self.model  # type: ignore[attr-defined]
        if hook == "training_step" and model is not None and model is not module:
            # through the wrapper's forward, as Lightning does: DDP prepares its reducer there
            redirect = self._forward_redirection  # type: ignore[attr-defined]
            return redirect(model, module, hook, mb.inputs, *args, **kwargs)
        return getattr(module, hook)(mb.inputs, *args, **kwargs)

    def _check_plan(self, rank_batch: RankBatch) -> None:
        if not self._skrull_config.verify_plans or rank_batch.world_size == 1:
            return
        from lightning_skrull.engine import check_same_plan

        device = self.root_device  # type: ignore[attr-defined]
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
        import dataclasses
        import logging

        import torch.distributed as dist

        from lightning_skrull.memory import (
            AUTO_PROBE_TOKENS,
            AUTO_SAFETY_MARGIN,
            NONLINEAR_FIT_ERROR,
            ProbeStep,
            auto_bucket_size,
            describe_fit,
        )
        from lightning_skrull.models.patching import find_hf_model

        log = logging.getLogger(__name__)
        config = self._skrull_config
        layout = self.parallel_layout
        device = self.root_device  # type: ignore[attr-defined]
        module = self.lightning_module  # type: ignore[attr-defined]
        hf_model = find_hf_model(module, attribute=config.model_attribute)
        optimizers = self.optimizers  # type: ignore[attr-defined]
        precision: Precision = self.precision_plugin  # type: ignore[attr-defined]
        probe = ProbeStep(
            hf_model,
            optimizers[0] if optimizers else None,
            cp_rank=layout.cp_rank,
            cp_size=layout.cp_size,
            cp_group=layout.cp_group,
            backend=config.attention_backend,
            device=device,
            vocab_size=int(hf_model.config.vocab_size),
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
        module = self.lightning_module  # type: ignore[attr-defined]
        precision: Precision = self.precision_plugin  # type: ignore[attr-defined]
        optimizer = self.optimizers[0] if self.optimizers else None  # type: ignore[attr-defined]
        scaler = getattr(precision, "scaler", None)
        tensor = scaler.scale(loss) if scaler is not None else loss
        precision.backward(tensor, module, optimizer)

    def _stash_gradients(self) -> None:
        """Keep the earlier micro-batches' gradients away from Lightning's ``zero_grad``.

        Lightning's closure calls ``optimizer.zero_grad()`` after the training step and before
        the backward it runs itself; the stash moves the accumulated ``.grad`` tensors aside
        (no copy) and :meth:`backward` puts them back before the last micro-batch's backward.
        """
        module = self.lightning_module  # type: ignore[attr-defined]
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
        module = self.lightning_module  # type: ignore[attr-defined]
        for p in module.parameters():
            p.grad = None

    def _close_last_context(self) -> None:
        if self._last_context is not None:
            context, self._last_context = self._last_context, None
            context.close()

    def _skrull_training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._step_start = time.perf_counter()
        self._close_last_context()
        self._stashed_grads = []
        rank_batch, stats = self._as_rank_batch(args[0], "training_step")
        self._check_plan(rank_batch)
        rest = args[1:]
        micro_batches = rank_batch.micro_batches
        if not micro_batches:
            raise RuntimeError(
                "this rank got no micro-batch for the step; every rank must run at least one "
                "forward and backward (the data module pads with an empty micro-batch)."
            )
        precision: Precision = self.precision_plugin  # type: ignore[attr-defined]
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
                    with self._earlier_micro_batch_sync_context(), self._micro_batch_context(mb):
                        output = self._call_module_step("training_step", mb, rest, kwargs)
                        loss = self._required_loss(output, i)
                        self._earlier_micro_batch_backward(loss)
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
                output = self._call_module_step("training_step", micro_batches[-1], rest, kwargs)
                last = self._required_loss(output, last_index)
        finally:
            self._close_step_logs()
        logs.flush()
        # gradient flows through the last micro-batch only; the value is the rank's whole share
        share = last + torch.stack(earlier).sum() if earlier else last
        self._log_step(rank_batch, stats, share.detach(), "train", logs.names)
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
        precision: Precision = self.precision_plugin  # type: ignore[attr-defined]
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
            self._log_step(rank_batch, stats, share, stage, logs.names)
        return combine_outputs(outputs, logs.is_model_loss)

    # ------------------------------------------------------------------ user collectives
    def _open_step_logs(self, rank_batch: RankBatch) -> StepLogs:
        """Stand in for the module's ``self.log`` while this step's micro-batches run, note the
        model's loss of each micro-batch, and refuse collectives from user code meanwhile."""
        module = self.lightning_module  # type: ignore[attr-defined]
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
        module.log = logs.record  # an instance attribute shadows the method until closed
        self._in_micro_batches = True
        return logs

    def _close_step_logs(self) -> None:
        self._in_micro_batches = False
        if self._loss_hook is not None:
            self._loss_hook.remove()
            self._loss_hook = None
        module = self.lightning_module  # type: ignore[attr-defined]
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
    def all_gather(  # type: ignore[misc]
        self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False
    ) -> Tensor:
        self._refuse_in_micro_batches("all_gather (self.all_gather)")
        return super().all_gather(tensor, group=group, sync_grads=sync_grads)  # type: ignore[misc,no-any-return]

    @override
    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        self._refuse_in_micro_batches("strategy.reduce")
        return super().reduce(tensor, *args, **kwargs)  # type: ignore[misc]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:  # type: ignore[misc]
        self._refuse_in_micro_batches("strategy.broadcast")
        return super().broadcast(obj, src)  # type: ignore[misc]

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[misc]
        self._refuse_in_micro_batches("strategy.barrier")
        super().barrier(*args, **kwargs)  # type: ignore[misc]

    # ------------------------------------------------------------------ Lightning hooks
    # These override the hooks of the Lightning strategy this mixin is put in front of; the
    # mixin itself has no such base, so mypy's override check is silenced on each (misc).
    @override
    def setup(self, trainer: pl.Trainer) -> None:  # type: ignore[misc]
        self._check_trainer(trainer)
        self._prepare_hf_model()
        super().setup(trainer)  # type: ignore[misc]
        if self._skrull_config.bucket_size == AUTO_BUCKET:
            self._measure_bucket_size()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        return self._skrull_training_step(args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        return self._skrull_eval_step("validation_step", "validation", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        return self._skrull_eval_step("test_step", "test", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        raise RuntimeError(
            f"{type(self).__name__} does not support trainer.predict: generation needs a KV "
            "cache, which context-parallel attention does not keep. Predict with a plain "
            "strategy (e.g. 'ddp') on an unpatched model."
        )

    @override
    def backward(  # type: ignore[misc]
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        self._restore_gradients()
        try:
            return super().backward(closure_loss, optimizer, *args, **kwargs)  # type: ignore[misc,no-any-return]
        finally:
            self._close_last_context()

    @override
    def optimizer_step(  # type: ignore[misc]
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]
        self._log_throughput()
        return output

    @override
    def on_exception(self, exception: BaseException) -> None:  # type: ignore[misc]
        self._close_last_context()
        self._stashed_grads = []
        super().on_exception(exception)  # type: ignore[misc]

    @override
    def teardown(self) -> None:  # type: ignore[misc]
        self._close_last_context()
        self._stashed_grads = []
        super().teardown()  # type: ignore[misc]

    # ------------------------------------------------------------------ logging
    def _log_step(
        self,
        rank_batch: RankBatch,
        stats: Any,
        share: Tensor,
        stage: str,
        user_names: tuple[str, ...] = (),
    ) -> None:
        """Log the exact loss of the global batch and, in training, the plan statistics.

        ``share`` is this rank's sum of micro-batch losses, i.e. its token-loss sum over
        ``T / W``; its mean over the ``W`` ranks is the global token mean. Logged with
        ``batch_size = T``, Lightning's epoch-level weighted mean over batches and ranks is the
        token mean over the whole epoch. A name the module logged itself in this step
        (``user_names``) is left to the module's value.
        """
        if not self._skrull_config.log_stats:
            return
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is None or module._trainer is None or module._trainer.barebones:
            return
        on_step = stage == "train"
        if LOSS_KEYS[stage] in user_names:
            return
        module.log(
            LOSS_KEYS[stage],
            share.float(),
            on_step=on_step,
            on_epoch=not on_step,
            prog_bar=True,
            sync_dist=True,
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
        for key, value in values.items():
            module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    def _log_throughput(self) -> None:
        if self._step_start is None or not self._skrull_config.log_stats:
            return
        module = self.lightning_module  # type: ignore[attr-defined]
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


class SkrullStrategy(SkrullStrategyMixin, DDPStrategy):
    """DDP with Skrull scheduling: DP x CP groups, CP attention, one global batch per step.

    Use it with :class:`~lightning_skrull.SkrullDataModule`; the LightningModule stays plain
    (``training_step`` returns ``self.model(**batch).loss``).

    Args:
        cp_size: ranks in one context-parallel group; must divide the world size.
        bucket_size: token budget of one CP rank in one micro-batch, at least ``cp_size``
            (``None``: fit the longest sequence of the data, no memory bound; ``"auto"``: measured
            on CUDA at setup, see :class:`~lightning_skrull.config.SkrullConfig`).
        policy: scheduling policy (``"skrull"``, ``"dacp"``, ``"static"``, ``"sorted"``,
            ``"round_robin"``).
        attention_backend: ``"auto"``, ``"sdpa"`` or ``"flash"``.
        cost_model: the planner's cost model (default: from the HF model's config).
        model_attribute: dotted name of the HF model in the LightningModule, when it holds
            several.
        verify_plans: check every step that all ranks planned the same global batch.
        log_stats: log the exact loss, tokens/s and plan statistics.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
        **ddp_kwargs: passed to ``DistributedDataParallel``. The per-forward buffer sync
            (``forward_sync_buffers`` / ``broadcast_buffers``) is turned off: DP ranks may run
            different numbers of forwards per step.

    Raises:
        ValueError: a bad option (see :class:`~lightning_skrull.config.SkrullConfig`), or
            ``broadcast_buffers=True`` / ``forward_sync_buffers=True``.
    """

    strategy_name = "skrull"

    def __init__(
        self,
        cp_size: int = 1,
        bucket_size: int | Literal["auto"] | None = None,
        policy: str = "skrull",
        *,
        attention_backend: str = "auto",
        cost_model: CostModel | None = None,
        model_attribute: str | None = None,
        verify_plans: bool = True,
        log_stats: bool = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        config = SkrullConfig(
            cp_size=cp_size,
            bucket_size=bucket_size,
            policy=policy,
            attention_backend=attention_backend,
            cost_model=cost_model,
            model_attribute=model_attribute,
            verify_plans=verify_plans,
            log_stats=log_stats,
        )
        for key in ("broadcast_buffers", "forward_sync_buffers"):
            if ddp_kwargs.pop(key, None):
                raise ValueError(
                    f"{key}=True is not supported: DDP then syncs buffers in every forward, a "
                    "collective, and DP ranks run different numbers of micro-batches per step. "
                    "Buffers are synced once when DDP wraps the model; leave it unset."
                )
        ddp_kwargs[_NO_FORWARD_BUFFER_SYNC] = False
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        self._init_skrull(config)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._build_parallel_layout()

    @override
    def _earlier_micro_batch_sync_context(self) -> AbstractContextManager[Any]:
        return self.block_backward_sync()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        entries: tuple[tuple[str, str, dict[str, Any]], ...] = (
            ("skrull", "Skrull scheduling on DDP (CP size 1, launched like 'ddp')", {}),
            (
                "skrull_spawn",
                "Skrull scheduling on DDP, processes started with 'spawn' (notebooks, tests)",
                {"start_method": "spawn"},
            ),
            *(
                (
                    f"skrull_cp{n}",
                    f"Skrull scheduling on DDP with context-parallel groups of {n} ranks",
                    {"cp_size": n},
                )
                for n in (2, 4, 8)
            ),
        )
        for name, description, init_kwargs in entries:
            strategy_registry.register(name, cls, description=description, **init_kwargs)
