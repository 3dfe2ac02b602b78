"""``SkrullStrategy``: Skrull scheduling on Lightning's DDP.

:class:`SkrullStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (gloo on
CPU, NCCL on GPU, launched the way Lightning launches DDP) plus the Skrull pieces of
:class:`~lightning_skrull.strategies.base.SkrullStrategyMixin`; the earlier micro-batches of a
step run their backward under DDP ``no_sync``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from lightning_skrull.attention.backends import AttentionBackend
from lightning_skrull.config import Calibration, SkrullConfig
from lightning_skrull.models.families.vision_language import text_only_unused_parameters
from lightning_skrull.models.modes import cast_trainable_parameters
from lightning_skrull.scheduling import Policy
from lightning_skrull.strategies.base import SkrullStrategyMixin
from lightning_skrull.strategies.trainable import TrainableChange
from lightning_skrull.strategies.weight_averaging import match_averaged_dtypes

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_skrull.scheduling.cost_model import CostModel

_NO_FORWARD_BUFFER_SYNC = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters
    else "broadcast_buffers"
)
"""DDP's argument that turns off the per-forward buffer sync (renamed in torch 2.13)."""

FLOAT32_MASTER_PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
"""Lightning precisions whose weights and optimizer step are float32: trainable parameters
loaded in 16 bits are cast to float32 when the fit starts
(:func:`~lightning_skrull.models.modes.cast_trainable_parameters`)."""

HALF_DTYPES = (torch.bfloat16, torch.float16)
"""The 16-bit dtypes whose trainable parameters :class:`SkrullStrategy` casts to float32."""


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
        calibration: ``"online"`` (default): refit the cost model to measured micro-batch times
            while training (see :class:`~lightning_skrull.config.SkrullConfig`); ``"off"``: keep
            it as given.
        model_attribute: dotted name of the HF model in the LightningModule, when it holds
            several.
        verify_plans: check every step that all ranks planned the same global batch.
        log_stats: log the exact loss and tokens/s (every step) and the plan statistics (on
            Lightning's logging steps, every ``log_every_n_steps``).
        chunked_loss: compute the loss with the chunked LM head + cross-entropy, never holding
            the ``[tokens, vocab]`` logits (``logits`` is then ``None`` in the model's output
            when it is given labels); ``False`` for transformers' dense head, with logits.
        loss_kernel: what computes the chunked loss: ``"auto"`` (a fused CUDA kernel, Liger
            Kernel or Cut Cross-Entropy, when installed and on CUDA; else pure-PyTorch chunks),
            ``"chunked"``, ``"liger"`` or ``"cce"``; a fused kernel not installed is refused here.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
            process_group_backend, timeout, start_method: as for Lightning's ``DDPStrategy``.
        **ddp_kwargs: passed to ``DistributedDataParallel``. The per-forward buffer sync
            (``forward_sync_buffers`` / ``broadcast_buffers``) is turned off: DP ranks may run
            different numbers of forwards per step. A run of one process is not wrapped in DDP
            (its all-reduce would be the identity) unless a DDP communication hook is given.

    Raises:
        ValueError: a bad option (see :class:`~lightning_skrull.config.SkrullConfig`),
            ``broadcast_buffers=True`` / ``forward_sync_buffers=True``, or
            ``static_graph=True``.
        TypeError: an on/off option that is not a bool, or a ``cost_model`` that is not a
            :class:`~lightning_skrull.scheduling.CostModel`.
    """

    strategy_name = "skrull"

    def __init__(
        self,
        cp_size: int = 1,
        bucket_size: int | Literal["auto"] | None = None,
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
            calibration=calibration,
            model_attribute=model_attribute,
            verify_plans=verify_plans,
            log_stats=log_stats,
            chunked_loss=chunked_loss,
            loss_kernel=loss_kernel,
        )
        for key in ("broadcast_buffers", "forward_sync_buffers"):
            if ddp_kwargs.pop(key, None):
                raise ValueError(
                    f"{key}=True is not supported: DDP then syncs buffers in every forward, a "
                    "collective, and DP ranks run different numbers of micro-batches per step. "
                    "Buffers are synced once when DDP wraps the model; leave it unset."
                )
        if ddp_kwargs.get("static_graph"):
            raise ValueError(
                "static_graph=True is not supported: SkrullStrategy runs every micro-batch but a "
                "step's last under DDP's no_sync, and DDP's static graph with no_sync fails in "
                f"the first backward in torch {torch.__version__} (expect_autograd_hooks_ INTERNAL "
                "ASSERT, pytorch/pytorch#143580), and stops all-reducing gradients where that "
                "is worked around; the number of micro-batches also changes from step to step. "
                "Leave static_graph unset."
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
    def configure_ddp(self) -> None:
        """Give the fit float32 master weights where its precision has them, then wrap the
        module in DDP, except in a world of one process without a communication hook.

        transformers 5 loads a checkpoint in the dtype it is stored in (``dtype="auto"``), bf16
        for most, and Lightning's ``"bf16-mixed"`` only opens an autocast: left as loaded, the
        gradients would accumulate over a step's micro-batches in bf16 and the optimizer would
        step bf16 weights, where updates below a weight's bf16 resolution (2^-8 of it) are lost.
        Under ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` trainable 16-bit parameters are
        therefore cast to float32 (as :class:`~lightning_skrull.SkrullFSDPStrategy` does); frozen
        ones, such as a LoRA model's bf16 base, stay as loaded. ``"bf16-true"`` keeps bf16.

        In a world of one process the gradient all-reduce is the identity, and DDP's reducer
        (its gradient buckets, hooks and a one-rank all-reduce) is pure overhead: 2-4 ms of a
        20 ms step of four short sequences on CPU (docs/benchmarks.md). Lightning does not wrap
        a single-device run either.
        """
        self._use_float32_master_weights()
        if self.world_size == 1 and self._ddp_comm_hook is None and self._ddp_comm_state is None:
            return
        self._ignore_text_only_unused_parameters()
        super().configure_ddp()

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load a checkpoint's weights; a fit resumed from it gets its float32 master weights
        first.

        Lightning restores a DDP strategy's checkpoint before the strategy's setup, where
        :meth:`configure_ddp` casts the trainable 16-bit parameters to float32. A fit resumed
        with a model loaded in bf16 would copy the checkpoint's float32 master weights into
        the bf16 parameters, rounding each to 2^-8 of itself, and only then cast them: every
        resume would lose the updates below bf16's resolution (measured on a
        ``StochasticWeightAveraging`` fit at DP=2 x CP=2: the weights after the resume off by
        3.8e-3). The cast therefore runs here, before the copy, and so does the cast of a
        weight-averaging callback's copy, before the callback's state is restored into it.
        """
        module = self.lightning_module
        if module is not None and module._trainer is not None:
            if module._trainer.state.fn == TrainerFn.FITTING:
                self._use_float32_master_weights()
        super().load_model_state_dict(checkpoint, strict=strict)

    def _use_float32_master_weights(self) -> None:
        precision = self.precision_plugin.precision
        if precision not in FLOAT32_MASTER_PRECISIONS or self.model is None:
            return
        cast = cast_trainable_parameters(self.model, torch.float32, from_dtypes=HALF_DTYPES)
        module = self.lightning_module
        if cast and module is not None and module._trainer is not None:
            # a weight-averaging callback copied the module before this cast: its copy steps
            # alike, or it would average in bf16 and round these weights in every swap
            match_averaged_dtypes(module._trainer, self.model)
        if cast:
            rank_zero_info(
                f"{type(self).__name__}: cast {cast} trainable bf16/fp16 parameters to float32 "
                f"master weights (precision={precision!r} steps float32 weights). Load the "
                "model with dtype=torch.float32 to skip the cast, or use precision='bf16-true' "
                "to train the bf16 weights as they are."
            )

    def _ignore_text_only_unused_parameters(self) -> None:
        """Leave a vision-language model's vision tower and projector out of DDP's gradient
        reduction: trained on text only they never get a gradient, and DDP, which waits for one
        of every parameter it reduces, would fail at the next step.

        torch has no public way to do so. ``find_unused_parameters=True`` would all-reduce the
        tower's zero gradients every step (Gemma 3's SigLIP tower holds 0.4B parameters) after
        walking the autograd graph, and freezing the tower (``requires_grad_(False)``) would
        change the user's model (and keep the tower in its loaded dtype under the float32
        master cast). So this uses ``DistributedDataParallel._set_params_and_buffers_to_ignore_
        for_model``, a private API; the DDP runs of tests/models/test_gemma3_multimodal.py fail if it
        changes, and its absence is refused here with a fix.

        Raises:
            RuntimeError: this torch's DDP has no such method; the message names the fix.
        """
        module = self.model
        hf_model = self._hf_model
        if module is None or hf_model is None:
            return
        unused = text_only_unused_parameters(hf_model)
        if not unused:
            return
        ignore = getattr(
            DistributedDataParallel, "_set_params_and_buffers_to_ignore_for_model", None
        )
        if ignore is None:
            raise RuntimeError(
                f"SkrullStrategy leaves the {len(unused)} parameters of "
                f"{type(hf_model).__name__} that text-only training never reaches (vision tower, "
                f"projector; first {unused[0]!r}) out of DDP's gradient reduction through "
                "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model, which "
                f"torch {torch.__version__} does not have. Freeze them (requires_grad_(False) "
                "on model.model.vision_tower and model.model.multi_modal_projector), or use "
                "SkrullFSDPStrategy or SkrullZero2Strategy, which need nothing."
            )
        prefix = next(name for name, sub in module.named_modules() if sub is hf_model)
        names = [f"{prefix}.{n}" if prefix else n for n in unused]
        ignore(module, names)

    @override
    def _earlier_micro_batch_sync_context(self) -> AbstractContextManager[Any]:
        return self.block_backward_sync()

    @override
    def _follow_trainable_change(self, change: TrainableChange) -> None:
        """Wrap the module in DDP again when parameters were frozen or unfrozen during the fit.

        DDP's reducer hooks and all-reduces the parameters that were trainable when it was
        built, and only those: a parameter unfrozen later (``BackboneFinetuning``) would step
        with each DP rank's own gradient and the ranks' weights would drift apart (plain
        Lightning's DDP does so, silently), and a parameter frozen later would leave the
        reducer waiting for its gradient. The new wrapper is built without DDP's initial
        broadcast (``init_sync=False``): every rank holds the same weights already. Newly
        trainable 16-bit parameters get float32 master weights first, as at setup. Every rank
        must make the same change before the same step, as Lightning's callbacks and hooks do.
        """
        self._use_float32_master_weights()
        model = self.model
        if not isinstance(model, DistributedDataParallel):
            return  # one process without a communication hook: nothing reduces gradients
        self.model = model.module
        del model  # the old reducer's hooks go with it
        kwargs = self._ddp_kwargs
        self._ddp_kwargs = {**kwargs, "init_sync": False}
        try:
            super().configure_ddp()
        finally:
            self._ddp_kwargs = kwargs
        trainer = self._attached_module.trainer
        rank_zero_info(
            f"{type(self).__name__}: the trainable parameters changed before global step "
            f"{trainer.global_step} ({change.describe()}); DDP, which reduces the gradients of "
            "the parameters trainable when it was built, is wrapped around the module again."
        )

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
