"""Skrull scheduling on DeepSpeed ZeRO-2 (the paper's base system), on GPU and on CPU.

:class:`SkrullZero2Strategy` is Lightning's :class:`~lightning.pytorch.strategies.DeepSpeedStrategy`
at ZeRO stage 2 (optimizer states and gradients partitioned over the world) plus the Skrull
pieces shared with :class:`~lightning_skrull.SkrullStrategy`. Three things differ from DDP:

- ZeRO-2 reduces (reduce-scatters) gradients in *every* backward, so every DP rank must run the
  same number of micro-batches: the data module pads the ranks with fewer to the plan's largest
  count with empty micro-batches (one placeholder token, zero loss, zero gradient).
- DeepSpeed's own accumulation boundary marks the last micro-batch
  (``engine.set_gradient_accumulation_boundary``), so ``engine.step()`` steps once per global
  batch; ``gradient_accumulation_steps`` stays 1, so no loss is rescaled.
- DeepSpeed keeps the earlier micro-batches' gradients in its optimizer's own buffers, which
  the optimizer's ``zero_grad`` clears (the BF16 optimizer of ZeRO-1 with bf16 and fp32
  accumulation, ZeRO-1's ``grad_accum`` when it accumulates in another dtype than the model's).
  Lightning calls ``zero_grad`` after ``training_step``, before the last micro-batch's
  backward, so from the last micro-batch's forward until that backward the optimizer's
  ``zero_grad`` does nothing. The engine zeroes the gradients itself after each step.

On CPU (gloo) three things of Lightning's DeepSpeedStrategy are relaxed: its CUDA-only check in
``setup_environment``, its device-index check, and ``device_rank`` (the local rank instead of a
CUDA index). DeepSpeed's shared-memory all-reduce op, which it JIT-compiles at start-up (about
35 s) and uses only for inference all-reduces, is not built: training collectives go through
``torch.distributed``.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import LightningModule
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_skrull.attention.backends import AttentionBackend
from lightning_skrull.config import Calibration, SkrullConfig
from lightning_skrull.models.saving import cpu_state_dict
from lightning_skrull.scheduling import Policy
from lightning_skrull.strategies.base import SkrullStrategyMixin
from lightning_skrull.strategies.trainable import TrainableChange

if TYPE_CHECKING:
    import deepspeed
    import lightning.pytorch as pl

    from lightning_skrull.scheduling.cost_model import CostModel

FP16_PRECISIONS = ("16-mixed", "16-true")
"""Lightning ``precision`` values that turn on DeepSpeed's fp16 (CUDA only)."""

SHM_OP_NAME = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory communication op (CPU inference all-reduce), skipped on CPU."""


ZERO_PARTITION_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt")
"""A ZeRO optimizer partition in a DeepSpeed checkpoint's tag folder (one per process)."""

_MISSING = object()
"""Marks an optimizer that had no ``zero_grad`` of its own before it was held."""


def saved_zero_partitions(checkpoint_dir: str | Path) -> int | None:
    """Optimizer partitions in a DeepSpeed checkpoint directory, i.e. the processes of the run
    that wrote it (``None``: no ``latest`` tag or no partition file to count)."""
    directory = Path(checkpoint_dir)
    latest = directory / "latest"
    if not latest.is_file():
        return None
    folder = directory / latest.read_text().strip()
    if not folder.is_dir():
        return None
    ranks = {m.group(1) for f in folder.iterdir() if (m := ZERO_PARTITION_FILE.fullmatch(f.name))}
    return len(ranks) or None


def _keep_gradients(*args: Any, **kwargs: Any) -> None:
    """``zero_grad`` of a held optimizer: keep the pending micro-batches' gradients."""


class _HeldZeroGrad:
    """Makes ``zero_grad`` a no-op on some optimizer objects until released.

    The no-op is set as an instance attribute, which takes precedence over the class's method;
    releasing puts back what the instance had before (usually nothing, i.e. the class's method).
    """

    def __init__(self) -> None:
        self._held: list[tuple[object, Any]] = []

    @property
    def active(self) -> bool:
        """Whether some optimizer's ``zero_grad`` is held now."""
        return bool(self._held)

    def hold(self, optimizers: Sequence[object]) -> None:
        """Make ``zero_grad`` of each of ``optimizers`` a no-op (once per object)."""
        for optimizer in optimizers:
            if any(held is optimizer for held, _ in self._held):
                continue
            self._held.append((optimizer, vars(optimizer).get("zero_grad", _MISSING)))
            vars(optimizer)["zero_grad"] = _keep_gradients

    def release(self) -> None:
        """Give every held optimizer its own ``zero_grad`` back."""
        held, self._held = self._held, []
        for optimizer, previous in reversed(held):
            if previous is _MISSING:
                vars(optimizer).pop("zero_grad", None)
            else:
                vars(optimizer)["zero_grad"] = previous


@contextmanager
def _without_shm_comm_op() -> Iterator[None]:
    """Keep ``deepspeed.init_distributed`` from JIT-compiling the shared-memory op."""
    import deepspeed.ops

    compatible = deepspeed.ops.__compatible_ops__
    saved = compatible.get(SHM_OP_NAME)
    compatible[SHM_OP_NAME] = False
    try:
        yield
    finally:
        if saved is None:
            compatible.pop(SHM_OP_NAME, None)
        else:
            compatible[SHM_OP_NAME] = saved


ENGINE_HOOKS = {
    "backward": (
        "DeepSpeed's engine runs every backward itself and Lightning's DeepSpeed precision "
        "plugin skips the override (with a warning only), so whatever it does to the loss (a "
        "scale, an extra term) would not reach the gradient"
    ),
    "configure_gradient_clipping": (
        "the gradients live in DeepSpeed's partitions (.grad is None), where Lightning's "
        "clip_gradients does nothing, so the hook would run and clip nothing; clip by norm with "
        "Trainer(gradient_clip_val=...), which DeepSpeed applies to the whole gradient"
    ),
}
"""LightningModule hooks a fit under :class:`SkrullZero2Strategy` refuses, with the reason."""


class SkrullZero2Strategy(SkrullStrategyMixin, DeepSpeedStrategy):
    """DeepSpeed ZeRO-2 with Skrull scheduling; runs on CUDA (NCCL) and on CPU (gloo).

    Args:
        bucket_size: as for :class:`~lightning_skrull.SkrullStrategy`, but ``"auto"`` is
            refused: give a number of tokens (measured once with ``SkrullStrategy`` on the same
            GPU and model, for example).
        cp_size, policy, attention_backend, cost_model, calibration,
            model_attribute, verify_plans, log_stats, chunked_loss, loss_kernel: as for
            :class:`~lightning_skrull.SkrullStrategy`. Under ZeRO-2 every DP rank runs the same
            number of micro-batches and the gradient reduction runs inside each backward, so
            a micro-batch's timed span can include waiting for other DP ranks there.
        config: a DeepSpeed config (dict or JSON path) to start from; its
            ``zero_optimization.stage`` must be 1 or 2 if given.
        accelerator, parallel_devices, cluster_environment, precision_plugin,
            process_group_backend, timeout: as for Lightning's ``DeepSpeedStrategy``.
        **deepspeed_kwargs: other ``DeepSpeedStrategy`` arguments (``overlap_comm``,
            ``reduce_bucket_size``, ``offload_optimizer``, ...). ``stage`` is fixed to 2.

    Raises:
        ValueError: a bad Skrull option, ``stage`` other than 2, or a config with ZeRO-3; when
            fitting from ``ckpt_path``, a checkpoint written by another number of processes
            (its optimizer partitions cannot be split anew; ``cp_size`` may change), or a
            Lightning weight-averaging callback (see :attr:`weight_averaging_refusal`), or a
            compiled model (see :attr:`compile_refusal`); when fitting, a LightningModule that
            overrides ``backward`` or ``configure_gradient_clipping`` (see
            :data:`ENGINE_HOOKS`).
    """

    strategy_name = "skrull_zero2"
    requires_equal_micro_batches = True
    masters_apart_in = ("bf16-mixed", "bf16-true", *FP16_PRECISIONS)
    checkpoint_kinds = ("deepspeed",)
    weight_averaging_refusal = (
        "DeepSpeed keeps the weights the optimizer steps (float32 masters in its partitions) "
        "and the checkpoint apart from the module, so the average is lost from checkpoints "
        "(Lightning's DeepSpeedStrategy saves no 'state_dict', and resuming fails with "
        "KeyError: 'state_dict'), and the average the callback copies into the module when "
        "training ends never reaches the master weights that save_pretrained writes and a "
        "further fit steps"
    )
    compile_refusal = (
        "not tested under DeepSpeed, whose engine wraps the module and hooks every parameter's "
        "gradient (Lightning refuses trainer.fit(torch.compile(module)) under DeepSpeed too)"
    )

    def __init__(
        self,
        cp_size: int = 1,
        bucket_size: int | None = None,
        policy: Policy = "skrull",
        *,
        attention_backend: AttentionBackend = "auto",
        cost_model: CostModel | None = None,
        calibration: Calibration = "online",
        model_attribute: str | None = None,
        verify_plans: bool = True,
        log_stats: bool = True,
        chunked_loss: bool = True,
        loss_kernel: str = "auto",
        config: str | Path | dict[str, Any] | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **deepspeed_kwargs: Any,
    ) -> None:
        skrull_config = SkrullConfig(
            cp_size=cp_size,
            bucket_size=bucket_size,
            policy=policy,
            attention_backend=attention_backend,
            cost_model=cost_model,
            calibration=calibration,
            model_attribute=model_attribute,
            verify_plans=verify_plans,
            log_stats=log_stats,
            chunked_loss=chunked_loss,
            loss_kernel=loss_kernel,
        )
        if bucket_size == "auto":
            raise ValueError(
                "bucket_size='auto' is measured by SkrullStrategy and SkrullFSDPStrategy only: "
                "ZeRO-2 reduces gradients inside every backward, so its probe steps cannot run "
                "apart from the engine. Give bucket_size as a number of tokens per CP rank "
                "(measure it once with SkrullStrategy(bucket_size='auto') on the same GPU and "
                "model)."
            )
        stage = deepspeed_kwargs.pop("stage", 2)
        if stage != 2:
            fix = (
                "For ZeRO stage 1 give it in the DeepSpeed config: "
                "config={'zero_optimization': {'stage': 1}}."
                if stage == 1
                else "ZeRO-3 partitions the parameters, which the context-parallel attention "
                "does not gather: leave stage unset, or shard the parameters with "
                "SkrullFSDPStrategy."
            )
            raise ValueError(f"SkrullZero2Strategy runs ZeRO stage 2, got stage={stage!r}. {fix}")
        if isinstance(config, dict):
            config = {"train_micro_batch_size_per_gpu": 1, **config}
        super().__init__(
            accelerator=accelerator,
            stage=2,
            config=config,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **deepspeed_kwargs,
        )
        # a config given as a file is read by now: check its stage too
        zero = self.config.get("zero_optimization", {}) if isinstance(self.config, dict) else {}
        if isinstance(zero, dict) and zero.get("stage", 2) not in (1, 2):
            raise ValueError(
                f"the DeepSpeed config sets zero_optimization.stage={zero.get('stage')!r}; "
                "SkrullZero2Strategy supports stages 1 and 2 (ZeRO-3 partitions the parameters, "
                "which the context-parallel attention does not gather). Set the stage to 1 or "
                "2, or shard the parameters with SkrullFSDPStrategy."
            )
        # the loader yields whole global batches; DeepSpeed only logs this number
        if isinstance(self.config, dict):
            self.config.setdefault("train_micro_batch_size_per_gpu", 1)
        self._init_skrull(skrull_config)
        self._earlier_gradients_pending = False
        self._held_zero_grad = _HeldZeroGrad()

    # ------------------------------------------------------------------ CPU support
    @property
    def _on_cuda(self) -> bool:
        return isinstance(self.accelerator, CUDAAccelerator)

    @override
    def setup_environment(self) -> None:
        if self._on_cuda:
            super().setup_environment()
            return
        # DeepSpeedStrategy refuses anything but CUDA here; ZeRO-2 runs on CPU with gloo
        DDPStrategy.setup_environment(self)

    @override
    def setup_distributed(self) -> None:
        if self._on_cuda:
            super().setup_distributed()
        else:
            # the device-index check compares CPU devices (index None) with local ranks
            reset_seed()
            self.set_world_ranks()
            with _without_shm_comm_op():
                self._init_deepspeed_distributed()
        self._build_parallel_layout()

    @override
    def _check_trainer(self, trainer: pl.Trainer) -> None:
        super()._check_trainer(trainer)
        precision = str(getattr(self.precision_plugin, "precision", ""))
        if precision in FP16_PRECISIONS and not self._on_cuda:
            raise ValueError(
                f"{type(self).__name__} got precision {precision!r} on "
                f"{self.root_device.type}, but DeepSpeed runs fp16 on CUDA only (its engine "
                "refuses fp16 on CPU). On CPU use precision='bf16-mixed', 'bf16-true' or "
                "'32-true'; for fp16 on CPU, SkrullStrategy runs Lightning's "
                "MixedPrecision('16-mixed', device='cpu') plugin."
            )

        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING and module is not None:
            for hook, why in ENGINE_HOOKS.items():
                if is_overridden(hook, module, LightningModule):
                    raise ValueError(
                        f"{type(module).__name__} overrides LightningModule.{hook}, which "
                        f"{type(self).__name__} cannot run: {why}. Use SkrullStrategy or "
                        f"SkrullFSDPStrategy, or remove the override."
                    )

    def _device_rank(self) -> int:
        index = self.root_device.index
        return self.local_rank if index is None else index

    @override
    def _setup_model_and_optimizer(
        self,
        model: Module,
        optimizer: Optimizer | None,
        lr_scheduler: Any = None,
    ) -> tuple[deepspeed.DeepSpeedEngine, Optimizer]:
        import deepspeed

        parameters = [p for p in model.parameters() if p.requires_grad]
        engine, ds_optimizer, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=self.config,
            model=model,
            model_parameters=parameters,
            optimizer=optimizer,
            lr_scheduler=lr_scheduler,
            dist_init_required=False,
        )
        return engine, ds_optimizer

    @override
    def _initialize_deepspeed_inference(self, model: Module) -> None:
        import deepspeed

        assert isinstance(self.config, dict)
        inference_config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1}
        for key in ("fp16", "bf16"):
            if key in self.config:
                inference_config[key] = self.config[key]
        engine, _, _, _ = deepspeed.initialize(
            args=argparse.Namespace(device_rank=self._device_rank()),
            config=inference_config,
            model=model,
            optimizer=None,
            lr_scheduler=None,
            model_parameters=[],
            dist_init_required=False,
        )
        self.model = engine

    # ------------------------------------------------------------------ checkpoints
    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            self._refuse_other_partition_count(checkpoint_path)
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    def _refuse_other_partition_count(self, checkpoint_path: Any) -> None:
        """Refuse to resume training from optimizer partitions of another process count.

        ZeRO-2 splits the optimizer state over every process (DP x CP ranks), and DeepSpeed
        reads partition ``i`` back on process ``i`` only; it cannot split it anew.
        """
        engine = self.deepspeed_engine
        if engine is None or engine.load_universal_checkpoint():
            return
        saved = saved_zero_partitions(checkpoint_path)
        current = int(engine.seq_dp_world_size)
        if saved is None or saved == current:
            return
        layout = self.parallel_layout
        raise ValueError(
            f"Cannot resume {type(self).__name__} from {checkpoint_path}: its optimizer state is "
            f"split into {saved} ZeRO-2 partitions, one per process of the run that wrote it "
            "(ZeRO-2 partitions over every process, DP x CP ranks), but this run has "
            f"{current} processes (DP={layout.dp_size} x CP={layout.cp_size}), and DeepSpeed "
            "does not split a ZeRO-2 optimizer state anew. Resume on "
            f"{saved} processes (any cp_size that divides {saved}: the partitions follow the "
            "process count, not the DP size). Runs that must change their process count train "
            "with SkrullStrategy or SkrullFSDPStrategy, whose checkpoints resume on any layout."
        )

    # ------------------------------------------------------------------ saving
    @override
    def _trained_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with DeepSpeed's float32 master weights in place of the
        parameters the optimizer steps (under bf16 the model holds their bf16 copies); the
        frozen parameters and the buffers as the model holds them. A collective: every rank
        gathers each master from the partitions (``safe_get_full_fp32_param``, an all-reduce
        per parameter), in the model's parameter order; rank 0 keeps them."""
        from deepspeed.utils import safe_get_full_fp32_param

        hf_model = self._hf_model
        assert hf_model is not None
        masters: dict[int, torch.Tensor] = {}
        for param in hf_model.parameters():
            # None, on every rank, for a parameter the optimizer does not hold
            master = safe_get_full_fp32_param(param)
            if master is not None and self.global_rank == 0:
                masters[id(param)] = master.detach().cpu()
        if self.global_rank != 0:
            return {}
        return cpu_state_dict(hf_model, replace=masters)

    # ------------------------------------------------------------------ micro-batches
    def _set_boundary(self, is_boundary: bool) -> None:
        engine = self.model
        setter = getattr(engine, "set_gradient_accumulation_boundary", None)
        if setter is not None:
            setter(is_boundary)

    @override
    def _follow_trainable_change(self, change: TrainableChange) -> None:
        """Refuse parameters frozen or unfrozen during the fit: DeepSpeed partitions the
        parameters trainable when its engine is built into its optimizer and gradient buffers,
        so one unfrozen later would never be stepped and one frozen later would keep being
        stepped (by momentum and weight decay), both silently.

        Raises:
            ValueError: always; the message names the parameters and the fix.
        """
        step = self._attached_module.trainer.global_step
        raise ValueError(
            f"SkrullZero2Strategy: the trainable parameters changed during the fit, before "
            f"global step {step} ({change.describe()}). DeepSpeed builds its optimizer from the "
            "parameters trainable when the fit starts: a parameter unfrozen later would never "
            "be trained, and one frozen later would still be stepped. Freeze or unfreeze before "
            "trainer.fit (to train in phases, write each phase's model with "
            "trainer.strategy.save_pretrained(path) and fit a module loaded from it), or use "
            "SkrullStrategy or SkrullFSDPStrategy, which follow such changes."
        )

    @override
    def _earlier_micro_batch_sync_context(self) -> AbstractContextManager[Any]:
        @contextmanager
        def not_a_boundary() -> Iterator[None]:
            self._set_boundary(False)
            self._earlier_gradients_pending = True
            yield

        return not_a_boundary()

    @override
    def _before_last_micro_batch(self) -> None:
        self._set_boundary(True)
        if self._earlier_gradients_pending:
            self._earlier_gradients_pending = False
            self._hold_zero_grad()

    def _hold_zero_grad(self) -> None:
        """Keep Lightning's ``zero_grad`` (after ``training_step``) from clearing the earlier
        micro-batches' gradients in DeepSpeed's buffers; :meth:`backward` releases it.

        Both the DeepSpeed optimizer and its ``LightningOptimizer`` wrapper are held: the
        wrapper's class derives from the optimizer's, so ``wrapper.zero_grad()`` runs the
        optimizer's method on the same buffers.
        """
        optimizers = [*self.optimizers, *self._lightning_optimizers]
        self._held_zero_grad.hold(optimizers)

    def _release_zero_grad(self) -> None:
        self._earlier_gradients_pending = False
        self._held_zero_grad.release()

    @override
    def backward(
        self, closure_loss: torch.Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        self._release_zero_grad()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Any,
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            # the closure's backward has released it; a closure without backward must not
            # leave the next step's zero_grad held
            self._release_zero_grad()

    @override
    def on_exception(self, exception: BaseException) -> None:
        self._release_zero_grad()
        super().on_exception(exception)

    @override
    def teardown(self) -> None:
        self._release_zero_grad()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "skrull_zero2",
            cls,
            description="Skrull scheduling on DeepSpeed ZeRO-2 (GPU with NCCL, or CPU with gloo)",
        )
