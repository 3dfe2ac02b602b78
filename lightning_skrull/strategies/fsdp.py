"""``SkrullFSDPStrategy``: Skrull scheduling on FSDP2, parameters sharded inside the CP group.

The ranks of one CP group run in lockstep: every micro-batch's forward and backward is joined by
the whole group. So the parameters are sharded over the CP group and replicated across DP ranks:
FSDP2 (``torch.distributed.fsdp.fully_shard``) on a 2-D ``(dp, cp)`` device mesh, i.e. HSDP.

- ``shard="cp"``: each forward all-gathers a layer's parameters inside the CP group and each
  backward reduce-scatters its gradient there. The all-reduce across DP ranks runs once per
  step, in the last micro-batch's backward: the earlier micro-batches run with
  ``set_requires_all_reduce(False)``, so FSDP2 keeps their reduce-scattered gradient shards in
  its own buffer and adds them to the last one's before the all-reduce. DP ranks may run
  different numbers of micro-batches, as under DDP.
- ``shard="world"``: the parameters are sharded over every rank (a 1-D mesh). Every backward
  reduce-scatters over the world, so every DP rank runs the same number of micro-batches per
  step: the data module pads the ranks with fewer with empty micro-batches, as for ZeRO-2.

Two FSDP2 switches are deliberately left at their defaults: ``set_requires_gradient_sync(False)``
would skip the reduce-scatter as well and keep a full-size unsharded gradient between
micro-batches (the memory this strategy exists to save), and
``set_reshard_after_backward(False)`` would keep the unsharded parameters between
micro-batches (the same). ``set_is_last_backward`` stays ``True``: every backward waits for its
reduce-scatters.

The strategy takes over the part of Lightning's ``ModelParallelStrategy.setup`` that asks the
LightningModule for ``configure_model``: it applies ``fully_shard`` itself, to each decoder layer
of the Hugging Face model and to the model as the root, so the LightningModule stays plain. It
also replaces Lightning's materialisation of meta tensors (``reset_parameters``, random values):
a model built on the meta device on ranks other than 0 gets rank 0's weights
(:mod:`lightning_skrull.runtime.meta_init`), and meta tensors on rank 0 are refused.

Beside this module: :mod:`~lightning_skrull.strategies.fsdp_precision` (the precision plugin
and clipping on DTensor gradients), :mod:`~lightning_skrull.strategies.fsdp_sharding` (what
``fully_shard`` wraps), :mod:`~lightning_skrull.strategies.fsdp_generation` (the ranks'
meetings inside :meth:`SkrullFSDPStrategy.generating`) and
:mod:`~lightning_skrull.strategies.fsdp_checkpoint` (the checkpoint folders).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_skrull.attention.backends import AttentionBackend
from lightning_skrull.config import Calibration, SkrullConfig, check_bools
from lightning_skrull.runtime.meta_init import agree_on_meta_tensors, fill_from_rank_zero
from lightning_skrull.runtime.process_groups import once_per_world
from lightning_skrull.scheduling import Policy
from lightning_skrull.strategies.base import SkrullStrategyMixin
from lightning_skrull.strategies.fsdp_checkpoint import (
    consolidate_checkpoint,
    refuse_weights_only_resume,
)
from lightning_skrull.strategies.fsdp_generation import GenerationMeetings
from lightning_skrull.strategies.fsdp_precision import FSDPPrecision, as_fsdp_precision
from lightning_skrull.strategies.fsdp_sharding import refuse_parameters_outside, shard_decoder
from lightning_skrull.strategies.trainable import TrainableChange

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from transformers import PreTrainedModel

    from lightning_skrull.scheduling.cost_model import CostModel

ShardAxis = Literal["cp", "world"]
"""What the parameters are sharded over: the CP group (HSDP) or the whole world."""

SHARD_AXES: tuple[str, ...] = get_args(ShardAxis)

MESH_AXES = {"cp": ("dp", "cp"), "world": ("world",)}
"""Names of the device-mesh axes per ``shard``."""


class SkrullFSDPStrategy(SkrullStrategyMixin, ModelParallelStrategy):
    """FSDP2 with Skrull scheduling: parameters sharded over the CP group (or the world).

    Use it with :class:`~lightning_skrull.SkrullDataModule`; the LightningModule stays plain
    (``training_step`` returns ``self.model(**batch).loss``, no ``configure_model``). Every
    trainable parameter of the LightningModule must belong to its Hugging Face model. A model
    read on global rank 0 only and built on the meta device elsewhere
    (:func:`~lightning_skrull.models.from_pretrained_on_rank_zero`) is sharded, and its shards and
    buffers are filled from rank 0's weights at setup.

    Args:
        cp_size, policy, attention_backend, cost_model, calibration, model_attribute,
            verify_plans, log_stats, chunked_loss, loss_kernel: as for
            :class:`~lightning_skrull.SkrullStrategy`.
        bucket_size: as for :class:`~lightning_skrull.SkrullStrategy`; ``"auto"`` (CUDA)
            measures its probe steps on the sharded model.
        shard: ``"cp"``: parameters, gradients and optimizer states sharded over the CP group
            and replicated across DP ranks (HSDP; one DP all-reduce per step; DP ranks run
            their own micro-batch counts). ``"world"``: sharded over every rank (1/world of the
            model per rank; every DP rank runs the same micro-batch count).
        activation_checkpointing: recompute each decoder layer's activations in backward
            (transformers' gradient checkpointing, non-reentrant).
        reshard_after_forward: free each layer's gathered parameters after its forward and
            gather them again in backward (``False``: keep them until backward, more memory,
            one all-gather less per layer and micro-batch).
        save_distributed_checkpoint: ``True``: checkpoints are folders of per-rank shards written
            with ``torch.distributed.checkpoint``; ``False``: one file of full weights, gathered
            on rank 0.
        process_group_backend, timeout: as for Lightning's ``ModelParallelStrategy``.

    Raises:
        ValueError: a bad Skrull option, or ``shard`` not ``"cp"`` / ``"world"``; at setup,
            meta tensors on global rank 0 or outside the Hugging Face model, or a Lightning
            weight-averaging callback (``EMAWeightAveraging``, ``WeightAveraging``,
            ``StochasticWeightAveraging``; see :attr:`weight_averaging_refusal`), a compiled
            model (see :attr:`compile_refusal`), or a module whose model another Trainer's
            ``SkrullFSDPStrategy`` sharded (validate, test or fit it with that Trainer, or
            build a new module from its ``save_pretrained`` folder).
    """

    strategy_name = "skrull_fsdp"
    checkpoint_kinds = ("file", "distributed")
    weight_averaging_refusal = (
        "the callback copies the whole module before this strategy shards it, and then pairs "
        "the copy's full tensors with this rank's DTensor shards (torch stops at the first "
        "update: 'mixed torch.Tensor and DTensor'); averaging sharded weights would need a "
        "sharded copy, which the callback does not make"
    )
    compile_refusal = (
        "FSDP2's per-layer hooks gather and free the sharded parameters around each decoder "
        "layer, and compiling them with the layers is not tested here (Lightning refuses "
        "trainer.fit(torch.compile(module)) under this strategy too)"
    )
    # FSDP2 sets the sharded parameters' gradients itself after its reduce-scatter (no
    # gradient-accumulation hook fires), so the last micro-batch's backward cannot be told apart
    # from the DP all-reduce and the optimizer step: online calibration times only the earlier
    # micro-batches (each ends when its backward, reduce-scatter included, returns)
    _time_last_micro_batch = False

    generation_timeout: float = 300.0
    """Seconds :meth:`generating` waits for every rank to enter the block, and inside it to
    reach each ``generate`` call and the exit, before it raises (instead of hanging in an
    all-gather of ``generate``). Read when the Trainer sets the strategy up: it is the timeout
    of the gloo group the ranks meet on."""

    def __init__(
        self,
        cp_size: int = 1,
        bucket_size: int | Literal["auto"] | None = None,
        policy: Policy = "skrull",
        *,
        shard: ShardAxis = "cp",
        activation_checkpointing: bool = False,
        reshard_after_forward: bool = True,
        attention_backend: AttentionBackend = "auto",
        cost_model: CostModel | None = None,
        calibration: Calibration = "online",
        model_attribute: str | None = None,
        verify_plans: bool = True,
        log_stats: bool = True,
        chunked_loss: bool = True,
        loss_kernel: str = "auto",
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
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
        check_bools(
            activation_checkpointing=activation_checkpointing,
            reshard_after_forward=reshard_after_forward,
            save_distributed_checkpoint=save_distributed_checkpoint,
        )
        if shard not in SHARD_AXES:
            raise ValueError(
                f"shard={shard!r} is not one of {SHARD_AXES}: 'cp' shards the parameters over "
                "the CP group (replicated across DP ranks), 'world' over every rank."
            )
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self._init_skrull(config)
        self._shard: ShardAxis = shard
        self._activation_checkpointing = activation_checkpointing
        self._reshard_after_forward = reshard_after_forward
        self._sharded_model: nn.Module | None = None
        self._generation_meetings: GenerationMeetings | None = None  # made at setup
        # ZeRO-2 style padding: a reduce-scatter over the world in every backward
        self.requires_equal_micro_batches = shard == "world"

    # ------------------------------------------------------------------ properties
    @property
    def shard(self) -> ShardAxis:
        """What the parameters are sharded over (``"cp"`` or ``"world"``)."""
        return self._shard

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over (``cp_size``, or the world size)."""
        layout = self.parallel_layout
        return layout.cp_size if self._shard == "cp" else layout.world_size

    @property
    def sharded_model(self) -> FSDPModule:
        """The Hugging Face model, sharded (an ``FSDPModule``).

        Raises:
            RuntimeError: before ``setup`` sharded it.
        """
        if self._sharded_model is None:
            raise RuntimeError(
                "SkrullFSDPStrategy.sharded_model exists only after the Trainer's setup sharded "
                "the model (trainer.fit / validate / test)."
            )
        return cast(FSDPModule, self._sharded_model)

    @override
    def _own_sharded_model(self) -> nn.Module | None:
        return self._sharded_model

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    # ------------------------------------------------------------------ set-up
    @override
    def setup_environment(self) -> None:
        # ModelParallelStrategy's mesh has Lightning's (data_parallel, tensor_parallel) axes;
        # this one has (dp, cp), CP innermost, the same groups as the parallel layout
        self._setup_distributed()
        self._build_parallel_layout()
        layout = self.parallel_layout
        device_type = self.root_device.type
        if self._shard == "cp":
            shape: tuple[int, ...] = (layout.dp_size, layout.cp_size)
        else:
            shape = (layout.world_size,)
        names = MESH_AXES[self._shard]
        # made once per default group and reused by later fits, validates and tests
        # (runtime/process_groups.py): each new NCCL group would hold device memory
        self._device_mesh = once_per_world(
            ("mesh", device_type, shape, names),
            lambda: init_device_mesh(device_type, shape, mesh_dim_names=names),
        )
        module = self.lightning_module
        if module is not None:
            module._device_mesh = self._device_mesh
        if layout.world_size > 1:  # a collective: every rank builds it in the same order
            self._generation_meetings = GenerationMeetings.of_world(
                timeout=self.generation_timeout, rank=self.global_rank
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup without its configure_model requirement: the strategy
        # shards the Hugging Face model itself
        assert self.model is not None
        assert self.accelerator is not None
        self._check_trainer(trainer)
        self.precision_plugin = as_fsdp_precision(self.precision_plugin)
        self._prepare_hf_model()
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        full_state = self._rank_zero_weights_for_meta_ranks()
        self._shard_model()  # turns on activation checkpointing
        self._train_mode_for_fit(trainer)
        if full_state is not None:
            fill_from_rank_zero(cast(nn.Module, self.sharded_model), full_state, self.root_device)
            del full_state
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        if self._skrull_config.bucket_size == "auto":
            self._measure_bucket_size()
        self._setup_calibration(trainer)
        self._setup_stop_agreement(trainer)
        self._watch_trainable_parameters(trainer)

    def _rank_zero_weights_for_meta_ranks(self) -> dict[str, Tensor] | None:
        """Rank 0's full state dict (``{}`` on the other ranks) when some rank built the model on
        the meta device; ``None`` when every rank holds its weights. A collective.

        Raises:
            ValueError: rank 0 itself has meta tensors (nothing to fill the others from), or a
                rank has some outside the Hugging Face model.
        """
        hf_model = self._hf_model
        assert hf_model is not None
        meta = agree_on_meta_tensors(self._attached_module, hf_model, self.root_device)
        if not meta.anywhere:
            return None
        if meta.outside_model:
            raise ValueError(
                "SkrullFSDPStrategy fills meta tensors of the Hugging Face model only, but the "
                f"LightningModule has some outside it ({list(meta.local_outside[:5])} on this "
                "rank); "
                "they would have no values. Build everything outside the model on a real device."
            )
        if meta.on_rank_zero:
            raise ValueError(
                "SkrullFSDPStrategy fills the ranks that built the model on the meta device from "
                f"global rank 0's weights, but rank 0's model has meta tensors too{meta.on_this_rank()}: there "
                "are no weights to fill them from (it would otherwise start from random values). "
                "Load the weights on rank 0: build the model with "
                "lightning_skrull.models.from_pretrained_on_rank_zero(name_or_path), or with "
                "AutoModelForCausalLM.from_pretrained on every rank, outside "
                "trainer.init_module(empty_init=True) (which builds it on the meta device on "
                "every rank; a resumed checkpoint would not fill the buffers it does not hold, "
                "such as RoPE's inv_freq)."
            )
        return hf_model.state_dict() if self.global_rank == 0 else {}

    def _shard_model(self) -> None:
        module = self._attached_module
        hf_model = self._hf_model
        assert hf_model is not None
        if hf_model is self._sharded_model:
            return  # set up again by the same Trainer (validate after fit)
        refuse_parameters_outside(module, hf_model)
        if self._activation_checkpointing:
            cast(Any, hf_model).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        precision = self.precision_plugin
        assert isinstance(precision, FSDPPrecision)
        mesh: DeviceMesh = self.device_mesh
        shard_decoder(
            hf_model,
            mesh=mesh,
            precision=precision,
            device=self.root_device,
            reshard_after_forward=self._reshard_after_forward,
        )
        self._sharded_model = hf_model

    @override
    def _follow_trainable_change(self, change: TrainableChange) -> None:
        """FSDP2 follows parameters frozen or unfrozen during the fit by itself: it
        reduce-scatters whatever gradients the backward leaves. Refused: a parameter unfrozen
        outside the sharded Hugging Face model (nothing would reduce its gradient), or one
        unfrozen in a dtype other than the float32 (bf16 under ``"bf16-true"``) master weights
        (it was left in its loaded dtype at setup, as frozen parameters are).

        Raises:
            ValueError: such a parameter was unfrozen; the message names it and the fix.
        """
        precision = self.precision_plugin
        assert isinstance(precision, FSDPPrecision)
        if self._hf_model is not None:  # the setup's check again
            refuse_parameters_outside(self._attached_module, self._hf_model)
        named = dict(self._attached_module.named_parameters())
        other_dtype = [
            f"{n} ({str(named[n].dtype).removeprefix('torch.')})"
            for n in change.unfrozen
            if named[n].is_floating_point() and named[n].dtype != precision.master_dtype
        ]
        if not other_dtype:
            return
        step = self._attached_module.trainer.global_step
        master = str(precision.master_dtype).removeprefix("torch.")
        raise ValueError(
            f"SkrullFSDPStrategy: parameters were unfrozen during the fit, before global step "
            f"{step}: {other_dtype[:3]}, frozen at setup and so sharded in the dtype they were "
            f"loaded in, not as {master} master weights. Make them trainable before "
            "trainer.fit, load the model in float32 (from_pretrained(..., dtype=torch.float32)), "
            "or use SkrullStrategy (DDP), which follows such changes and casts what is unfrozen "
            "to float32."
        )

    # ------------------------------------------------------------------ micro-batches
    @override
    def _earlier_micro_batch_sync_context(self) -> AbstractContextManager[Any]:
        if self._shard != "cp":
            # a 1-D mesh has no all-reduce to hold back: every backward reduce-scatters
            return nullcontext()
        return self._without_all_reduce()

    @contextmanager
    def _without_all_reduce(self) -> Iterator[None]:
        model = self.sharded_model
        model.set_requires_all_reduce(False)
        try:
            yield
        finally:
            model.set_requires_all_reduce(True)

    # ------------------------------------------------------------------ generation
    @contextmanager
    @override
    def generating(self) -> Iterator[PreTrainedModel]:
        """As :meth:`SkrullStrategy.generating`; every rank must enter the block and call
        ``generate``, and the model itself, the same number of times in the same order.

        Each forward all-gathers the sharded parameters, so a rank that generates alone
        (``if trainer.is_global_zero: ...``) or once more than the others would wait for them
        forever. On entry the ranks meet on a gloo group
        (``torch.distributed.monitored_barrier``); inside the block each ``generate`` call (at
        its first forward), each forward called on the model directly and the exit first
        exchange where they are (``generate`` call *k*, direct forward *k*, leaving after so
        many of each, or ``generate`` call *k* raised before its first forward, with the
        error) over the same group: one ``all_gather_object`` per meeting. A rank that is not
        there within :attr:`generation_timeout` seconds, ranks at different points, or a call
        that raised on some ranks (arguments ``generate`` refuses there) make every rank raise
        before any forward of that call.

        Raises:
            RuntimeError: as :meth:`SkrullStrategy.generating`; a rank did not enter the block,
                or reach a call or the exit, within :attr:`generation_timeout` seconds; the
                ranks called ``generate`` or the model different numbers of times (the message
                names each rank's point and the fix); or another rank's ``generate`` call
                raised before its first forward (the message carries its error; that rank
                raises its own); or, on exit, a call on this rank raised in the middle of its
                collectives and the error was caught inside the block (nothing with
                collectives is allowed on this rank afterwards: the run must end).
        """
        self._refuse_out_of_step()
        meetings = self._generation_meetings
        if meetings is not None:
            meetings.enter()
        with super().generating() as model:  # plain_attention: synced generate, reshard on exit
            if meetings is None:
                yield model
            else:
                with meetings.around_calls(model, self._fall_out_of_step):
                    yield model

    def _fall_out_of_step(self, message: str, caught: bool) -> None:
        """A model call inside :meth:`generating` raised in the middle of its collectives:
        refuse this rank anything with collectives from now on, at once when the error was
        caught inside the block."""
        self._out_of_step = message
        if caught:
            self._refuse_out_of_step()

    # ------------------------------------------------------------------ full weights
    def full_state_dict(self) -> dict[str, Tensor]:
        """The Hugging Face model's full (unsharded) weights on CPU, on global rank 0.

        A collective: every rank must call it; ranks other than 0 get an empty dict.
        """
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(cast(nn.Module, self.sharded_model), options=options)
        return cast(dict[str, Tensor], state)

    @override
    def _trained_state_dict(self) -> dict[str, Tensor]:
        return self.full_state_dict()

    @override
    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Load a checkpoint; refuse, naming the cause, to resume a fit from a folder without
        optimizer states (``ModelCheckpoint(save_weights_only=True)``), as Lightning's other
        strategies do
        (:func:`~lightning_skrull.strategies.fsdp_checkpoint.refuse_weights_only_resume`).

        Raises:
            KeyError: a fit resumed from a folder that holds the weights only.
        """
        if self.optimizers:
            refuse_weights_only_resume(Path(checkpoint_path))
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    consolidate_checkpoint = staticmethod(consolidate_checkpoint)  # a folder as one file

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            "skrull_fsdp",
            cls,
            description="Skrull scheduling on FSDP2, parameters sharded over the CP group (HSDP)",
        )
        strategy_registry.register(
            "skrull_fsdp_world",
            cls,
            description="Skrull scheduling on FSDP2, parameters sharded over every rank",
            shard="world",
        )
