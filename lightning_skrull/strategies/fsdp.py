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
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_skrull.attention.backends import AttentionBackend
from lightning_skrull.config import Calibration, SkrullConfig, check_bools
from lightning_skrull.models.modes import cast_trainable_parameters
from lightning_skrull.runtime.meta_init import agree_on_meta_tensors, fill_from_rank_zero
from lightning_skrull.runtime.process_groups import as_member, once_per_world
from lightning_skrull.scheduling import Policy
from lightning_skrull.strategies.base import SkrullStrategyMixin
from lightning_skrull.strategies.trainable import TrainableChange

if TYPE_CHECKING:
    import lightning.pytorch as pl
    from transformers import PreTrainedModel

    from lightning_skrull.scheduling.cost_model import CostModel

ShardAxis = Literal["cp", "world"]
"""What the parameters are sharded over: the CP group (HSDP) or the whole world."""

SHARD_AXES: tuple[str, ...] = get_args(ShardAxis)

FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
"""Lightning ``precision`` values the strategy runs (tested on CPU processes)."""

MESH_AXES = {"cp": ("dp", "cp"), "world": ("world",)}
"""Names of the device-mesh axes per ``shard``."""

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
"""Floating-point parameter dtypes whose frozen elements ranks compare before sharding."""


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a Hugging Face model, the units ``fully_shard`` wraps.

    They are the modules whose class is named in the model's ``_no_split_modules`` (transformers'
    own list of the blocks that must stay whole: ``Qwen2DecoderLayer``, ``LlamaDecoderLayer``).

    Raises:
        ValueError: the model names no such class, or none of its modules is one.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no decoder layers to shard: its _no_split_modules is "
            f"{sorted(names)!r} and no submodule has one of those classes. SkrullFSDPStrategy "
            "shards Hugging Face decoders (Qwen2/3, Llama, Mistral, their MoE variants); use "
            "SkrullStrategy or SkrullZero2Strategy for other models."
        )
    return layers


def clip_grad_norm_(parameters: list[nn.Parameter], max_norm: float) -> Tensor:
    """Clip the gradients of (possibly DTensor) parameters to a total 2-norm of ``max_norm``.

    The norm of a sharded gradient is the norm over its full tensor: the squares of the local
    shards are summed and all-reduced over the mesh axes the gradient is sharded on (a replicated
    axis contributes once). Returns the total norm before clipping, as a plain tensor.
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    local = [g for g in grads if not isinstance(g, DTensor)]
    sharded = [g for g in grads if isinstance(g, DTensor)]
    total = torch.zeros((), dtype=torch.float32, device=grads[0].device)
    for g in local:
        total = total + g.float().pow(2).sum()
    if sharded:
        # a sum of squares over DTensors is a partial DTensor: one all-reduce for all of them
        squares: Any = sum(g.float().pow(2).sum() for g in sharded)
        total = total + squares.full_tensor()
    norm = total.sqrt()
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        target = g.to_local() if isinstance(g, DTensor) else g
        target.mul_(coefficient.to(target.dtype))
    return norm


def check_frozen_dtypes_agree(model: nn.Module, device: torch.device) -> None:
    """Refuse a model whose frozen parameters have other dtypes on some rank (a collective).

    Frozen parameters are sharded in the dtype they were loaded in, so FSDP2 all-gathers the
    ranks' shards as they are: a rank holding a frozen weight in float32 while the others hold
    it in bf16 would gather shards of different sizes. The frozen elements of each floating
    dtype are counted and the counts compared across ranks (one all-reduce of a few numbers).

    Raises:
        ValueError: the counts differ; the message gives this rank's.
    """
    counts = torch.zeros(len(FLOAT_DTYPES), dtype=torch.int64, device=device)
    for p in model.parameters():
        if not p.requires_grad and p.dtype in FLOAT_DTYPES:
            counts[FLOAT_DTYPES.index(p.dtype)] += p.numel()
    low, high = counts.clone(), counts.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if torch.equal(low, high):
        return
    here = {str(d).removeprefix("torch."): int(n) for d, n in zip(FLOAT_DTYPES, counts) if n}
    raise ValueError(
        "SkrullFSDPStrategy shards frozen parameters in the dtype they were loaded in, and the "
        "ranks hold them in different dtypes (frozen elements per dtype on this rank: "
        f"{here}), so their shards cannot be gathered. Load the model with the same dtype on "
        "every rank (from_pretrained(..., dtype=torch.bfloat16) everywhere, or "
        "lightning_skrull.models.from_pretrained_on_rank_zero, which builds the other ranks' "
        "meta model in the checkpoint's dtype)."
    )


class FSDPPrecision(Precision):
    """Lightning's precision plugin for FSDP2: the dtype work is FSDP2's.

    - ``"32-true"``: float32 throughout.
    - ``"bf16-mixed"``: FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16,
      reduce_dtype=float32)``: the sharded parameters, their gradients and the optimizer stay
      float32; each all-gather casts to bf16, forward and backward run in bf16 (no autocast),
      gradients are reduced in float32.

    - ``"bf16-true"``: the module is cast to bf16 before it is sharded; parameters, gradients,
      reductions and the optimizer step are bf16.

    Under ``"32-true"`` and ``"bf16-mixed"``, trainable parameters loaded in another dtype
    (``from_pretrained(..., torch_dtype=torch.bfloat16)``) are cast to float32 one FSDP unit at
    a time as it is sharded, so a rank never holds more than the loaded model and one float32
    layer; the float32 shards are the master weights. Frozen parameters (``requires_grad=False``
    at setup: a LoRA model's base) keep the dtype they were loaded in: a bf16 base stays bf16
    shards, which ``param_dtype=bfloat16`` gathers without a cast (FSDP2 needs one dtype among
    the *trainable* parameters of a unit only). Under ``"32-true"`` such a model then runs as it
    does on one process: the bf16 base layers in bf16, the float32 adapters in float32 (peft
    casts their input and output).

    Gradient clipping by norm works on the DTensor gradients (:func:`clip_grad_norm_`).
    """

    def __init__(self, precision: str) -> None:
        if precision not in FSDP_PRECISIONS:
            raise ValueError(
                f"SkrullFSDPStrategy runs precision {FSDP_PRECISIONS}, got {precision!r}; fp16 "
                "needs a sharded gradient scaler, which is not supported. Use 'bf16-mixed'."
            )
        self.precision = precision  # type: ignore[assignment]

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy:
        """The ``MixedPrecisionPolicy`` given to ``fully_shard``."""
        if self.precision == "bf16-mixed":
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    @property
    def root_policy(self) -> MixedPrecisionPolicy:
        """The policy of the root module: :attr:`mixed_precision_policy` without casting its
        forward inputs. The root's only floating-point input is ``num_items_in_batch``, the
        loss's divisor, which must stay float32: cast to bf16 (8 significant bits) a count of
        257 supervised tokens becomes 256, and the loss and every gradient grow by 0.4%. The
        decoder layers keep the cast (their inputs come from the bf16 embedding anyway)."""
        policy = self.mixed_precision_policy
        return MixedPrecisionPolicy(
            param_dtype=policy.param_dtype,
            reduce_dtype=policy.reduce_dtype,
            output_dtype=policy.output_dtype,
            cast_forward_inputs=False,
        )

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the sharded parameters (what the optimizer steps)."""
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        if self.precision == "bf16-true":
            return module.to(torch.bfloat16)
        return module

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        clip_grad_norm_(parameters, float(clip_val))


_GENERATE, _FORWARD, _RAISED, _LEAVING, _LEAVING_BY_EXCEPTION = 0, 1, 2, 3, 4
"""Where a rank is when the ranks meet inside :meth:`SkrullFSDPStrategy.generating`: at the
first collective of a ``generate`` call, at a forward called on the model directly, out of a
``generate`` call that raised before its first collective, or leaving the block (normally or by
an exception)."""


class _ModelCalls:
    """One rank's calls of the model inside :meth:`SkrullFSDPStrategy.generating` (``generate``
    and forwards called directly), checked against the other ranks' before each call's first
    collective and at the block's exit.

    Each meeting all-gathers ``(where, generate calls, forwards, error)`` of every rank over the
    strategy's gloo group, whose timeout is :attr:`SkrullFSDPStrategy.generation_timeout`. A
    ``generate`` call meets when it reaches its first collective: its first forward (which
    all-gathers the sharded parameters), or the ``synced_gpus`` all-reduce of its decoding loop
    if that comes first; a call that raises before then (arguments that transformers'
    ``generate`` refuses on this rank only) meets with its error instead. A forward called on
    the model directly (a perplexity on the prompts, say) meets before it runs. Every rank
    raises at a meeting, before any forward of that call, when one rank's ``generate`` raised
    (that rank its own error, the others a ``RuntimeError`` carrying it) or when the ranks are at
    different points (one at its second ``generate`` call, another leaving after one); the ranks
    stay paired, so a run that catches the error on every rank trains on as if the block had not
    run. After a disagreement the block meets no more (a later call raises at once); after a
    ``generate`` that raised, the ranks agree on where they are and may call the model again.
    A ``generate`` or direct forward that raises after its first collective leaves without
    meeting (the others are inside its all-gathers): the error ends this process, and their
    collectives with it. Caught, it is recorded in :attr:`out_of_step`, and the strategy
    refuses the rank anything with collectives from then on. A meeting that times out raises too; gloo then closes the group's
    connections, so later blocks of the run raise at once.
    """

    def __init__(
        self, group: dist.ProcessGroup, timeout: float, rank: int, model: nn.Module
    ) -> None:
        self._group = group
        self._timeout = timeout
        self._rank = rank
        self._model = model
        self.calls = 0
        """``generate`` calls the ranks agreed on so far."""
        self.forwards = 0
        """Forwards called directly that the ranks agreed on so far."""
        self._failure: str | None = None
        self._generate_call: int | None = None
        """The ``generate`` call running, until it met the others."""
        self._generating = False
        """Inside a ``generate`` call (its later forwards do not meet)."""
        self._running = False
        """The ``generate`` call or direct forward met the others and went on into its
        collectives."""
        self.out_of_step: str | None = None
        """The call that raised in the middle of its collectives, leaving the others inside
        them: this rank's collectives no longer pair with theirs."""

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook of the model for the whole block (before FSDP2's own, which
        all-gathers): the first forward of a ``generate`` call, or a direct forward, meets."""
        if self._generate_call is not None:
            self._begin_generate_call()
        elif not self._generating:
            self._meet(_FORWARD, self.calls, self.forwards + 1)
            self.forwards += 1
            self._running = True

    def _begin_generate_call(self) -> None:
        """The running ``generate`` call reached its first collective: meet the others there,
        then let it run into its collectives."""
        call = self._generate_call
        if call is not None:
            self._generate_call = None
            self._meet(_GENERATE, call, self.forwards)
            self._running = True

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of the model for the whole block: a direct forward ended."""
        if not self._generating:
            self._running = False

    def wrap(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        """``generate`` meeting the other ranks at its first collective."""

        @functools.wraps(generate)
        def checked_generate(*args: Any, **kwargs: Any) -> Any:
            # generate(synced_gpus=False) is refused before any forward, on this rank alone
            if kwargs.get("synced_gpus", True) is False:
                return generate(*args, **kwargs)
            if self._failure is not None:
                self._refuse_after_failure()
            call = self.calls + 1
            self._generate_call, self._generating, self._running = call, True, False
            model = self._model
            # the synced_gpus all-reduce of the decoding loop (after the first forward in
            # transformers' greedy, sampling and beam search; before it in assisted decoding)
            unfinished = getattr(model, "_has_unfinished_sequences", None)
            if unfinished is not None:

                def meet_before_all_reduce(*a: Any, **k: Any) -> Any:
                    self._begin_generate_call()
                    return cast(Callable[..., Any], unfinished)(*a, **k)

                vars(model)["_has_unfinished_sequences"] = meet_before_all_reduce
            try:
                out = generate(*args, **kwargs)
                self._begin_generate_call()  # no collective ran: nor may the others'
            except Exception as err:
                if self._generate_call is not None:  # raised before any collective of the call
                    self._generate_call = None
                    self._meet(_RAISED, call, self.forwards, f"{type(err).__name__}: {err}")
                elif self._running:
                    # raised in the middle of the call: the other ranks are inside its
                    # all-gathers, which no meeting reaches. The block meets no more, so the
                    # error leaves at once and ends this process, and with it the others'
                    # collectives (an exit meeting would hold it for generation_timeout)
                    self._failure = f"generate raised after its first forward ({err})"
                    self.out_of_step = f"generate call {call} raised after its first forward"
                    self.out_of_step += f" ({type(err).__name__}: {err})"
                raise
            finally:
                self._generating = self._running = False
                vars(model).pop("_has_unfinished_sequences", None)
                self.calls = call
            return out

        return checked_generate

    def leave(self, where: int) -> None:
        """Meet the other ranks at the block's exit, unless a meeting of the block failed or a
        call raised after its first collective (the others are inside its all-gathers, which
        no meeting reaches: the error ends this process, and their collectives with it)."""
        if self._running:  # a direct forward met the others and never returned
            self.out_of_step = f"forward {self.forwards}, called directly, raised"
            self._failure = "a direct forward raised after it met the others"
        if self._failure is None:
            self._meet(where, self.calls, self.forwards)

    def _refuse_after_failure(self) -> None:
        raise RuntimeError(
            f"SkrullFSDPStrategy.generating() on global rank {self._rank}: the model was "
            f"called again after the block failed ({self._failure}); leave the block."
        )

    def _meet(self, where: int, calls: int, forwards: int, error: str = "") -> None:
        if self._failure is not None:
            self._refuse_after_failure()
        every: list[Any] = [None] * dist.get_world_size(self._group)
        try:
            dist.all_gather_object(every, (where, calls, forwards, error), group=self._group)
        except RuntimeError as err:
            self._failure = "a rank did not come"
            raise RuntimeError(
                f"SkrullFSDPStrategy.generating() on global rank {self._rank} "
                f"({_point(where, calls, forwards)}): not every rank came within "
                f"{self._timeout:g} s ({err}). Each forward of the model all-gathers the "
                "sharded parameters from every rank, so the ranks must reach each generate "
                "call, each forward called directly and the end of the block together; a rank "
                "is stuck or slow inside the block, or has died. A timeout closes the gloo "
                "group's connections, so this run cannot generate again: stop it, and raise "
                "SkrullFSDPStrategy.generation_timeout if a rank is merely slow."
            ) from err
        points = [(int(w), int(c), int(f), str(e)) for w, c, f, e in every]
        raised = [(rank, e) for rank, (w, _, _, e) in enumerate(points) if w == _RAISED]
        keys = {(_kind(w), c, f) for w, c, f, _ in points}
        if len(keys) == 1 and raised:
            if where == _RAISED:
                return  # this rank raises its own error
            errors = "; ".join(f"rank {rank}: {e}" for rank, e in raised)
            raise RuntimeError(
                f"SkrullFSDPStrategy.generating() on global rank {self._rank}: generate call "
                f"{calls} raised on rank{'s' * (len(raised) > 1)} "
                f"{', '.join(str(r) for r, _ in raised)} before its first forward ({errors}). "
                "This rank's call stops too, before any forward of it: each forward of "
                "generate all-gathers the sharded parameters from every rank, and the ranks "
                "that raised would not join. Fix that call's arguments on those ranks. The "
                "ranks stay paired: a run that catches this on every rank trains on "
                "unchanged, and may call generate again inside the block."
            )
        if len(keys) == 1:
            return
        self._failure = "the ranks called the model different numbers of times"
        ranks: dict[str, list[str]] = {}
        for rank, (w, c, f, _) in enumerate(points):
            ranks.setdefault(_point(w, c, f), []).append(str(rank))
        where_ranks = "; ".join(
            f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {p}" for p, r in ranks.items()
        )
        raise RuntimeError(
            f"SkrullFSDPStrategy.generating() on global rank {self._rank}: the ranks called "
            f"generate or the model different numbers of times ({where_ranks}). Each forward "
            "all-gathers the sharded parameters from every rank, so a rank calling the model "
            "more often than the others would wait for them forever. Call generate, and the "
            "model itself, the same number of times and in the same order on every rank "
            "inside the block (the prompts and max_new_tokens may differ: give every rank the "
            "same number of prompt batches). Every rank raises this before any forward of "
            "the call, so a run that catches it on every rank trains on unchanged."
        )


def _out_of_step_message(rank: int, call: str) -> str:
    """Why a rank whose model call raised inside :meth:`SkrullFSDPStrategy.generating` in the
    middle of its collectives may not train, validate, save or generate again."""
    return (
        f"SkrullFSDPStrategy on global rank {rank}: inside generating(), {call} on this rank "
        "while the other ranks were inside its parameter all-gathers, and the error was "
        "caught. This rank's collectives no longer pair with theirs: a step, a checkpoint or "
        "another generate call would exchange the wrong tensors with them or wait forever, "
        "so the run ends here. Let an error inside generating() end the run (do not catch "
        "it), fix its cause, and resume from the last checkpoint."
    )


def _kind(where: int) -> int:
    """What must agree between the ranks at a meeting: a ``generate`` call (raised or not), a
    direct forward, or the exit (by an exception or not)."""
    if where == _RAISED:
        return _GENERATE
    if where == _LEAVING_BY_EXCEPTION:
        return _LEAVING
    return where


def _point(where: int, calls: int, forwards: int) -> str:
    """Where a rank is inside :meth:`SkrullFSDPStrategy.generating`, in words."""
    if where == _GENERATE:
        return f"generate call {calls}"
    if where == _RAISED:
        return f"generate call {calls}, raised before its first forward"
    if where == _FORWARD:
        return f"forward {forwards}, called directly"
    how = " by an exception" if where == _LEAVING_BY_EXCEPTION else ""
    done = f"{calls} generate call{'s' * (calls != 1)}"
    if forwards:
        done += f" and {forwards} direct forward{'s' * (forwards != 1)}"
    return f"leaving the block{how} after {done}"


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
            verify_plans, log_stats, chunked_loss, loss_kernel: as for :class:`~lightning_skrull.SkrullStrategy`.
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
        self._generation_group: dist.ProcessGroup | None = None
        self._meeting_timeout = self.generation_timeout  # the group's, read at setup
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
            # the group's own timeout bounds what monitored_barrier leaves to it (the wait of
            # ranks other than 0) and the all-gathers of _ModelCalls; gloo's default is 30 min
            self._meeting_timeout = self.generation_timeout
            timeout = timedelta(seconds=self._meeting_timeout)
            self._generation_group = once_per_world(
                ("gloo", timeout),
                lambda: as_member(dist.new_group(backend="gloo", timeout=timeout)),
            )

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # ModelParallelStrategy.setup without its configure_model requirement: the strategy
        # shards the Hugging Face model itself
        assert self.model is not None
        assert self.accelerator is not None
        self._check_trainer(trainer)
        self.precision_plugin = self._fsdp_precision(self.precision_plugin)
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

    @staticmethod
    def _fsdp_precision(plugin: Precision) -> FSDPPrecision:
        if isinstance(plugin, FSDPPrecision):
            return plugin
        return FSDPPrecision(str(getattr(plugin, "precision", "32-true")))

    def _shard_model(self) -> None:
        module = self._attached_module
        hf_model = self._hf_model
        assert hf_model is not None
        if hf_model is self._sharded_model:
            return  # set up again by the same Trainer (validate after fit)
        self._refuse_parameters_outside(module, hf_model)
        if self._activation_checkpointing:
            cast(Any, hf_model).gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        precision = self.precision_plugin
        assert isinstance(precision, FSDPPrecision)
        policy = precision.mixed_precision_policy
        mesh: DeviceMesh = self.device_mesh
        check_frozen_dtypes_agree(hf_model, self.root_device)
        for layer in decoder_layers(hf_model):
            cast_trainable_parameters(layer, precision.master_dtype)
            fully_shard(
                layer,
                mesh=mesh,
                mp_policy=policy,
                reshard_after_forward=self._reshard_after_forward,
            )
        cast_trainable_parameters(hf_model, precision.master_dtype)
        fully_shard(hf_model, mesh=mesh, mp_policy=precision.root_policy)
        self._sharded_model = hf_model

    @staticmethod
    def _refuse_parameters_outside(module: nn.Module, hf_model: nn.Module) -> None:
        inside = {id(p) for p in hf_model.parameters()}
        outside = [
            n for n, p in module.named_parameters() if p.requires_grad and id(p) not in inside
        ]
        if outside:
            raise ValueError(
                f"SkrullFSDPStrategy shards the Hugging Face model only, but the LightningModule "
                f"has trainable parameters outside it: {outside[:5]}; their gradients would "
                "never be reduced across ranks. Move them into the model, freeze them "
                "(requires_grad=False), or use SkrullStrategy (DDP)."
            )

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
            self._refuse_parameters_outside(self._attached_module, self._hf_model)
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
        self._meet_to_generate()
        with super().generating() as model:
            group = self._generation_group
            if group is None:
                yield model
                return
            calls = _ModelCalls(group, self._meeting_timeout, self.global_rank, model)
            # wraps plain_attention's generate (synced_gpus=True), which it takes off on exit
            vars(model)["generate"] = calls.wrap(cast(Any, model).generate)
            hooks = (
                model.register_forward_pre_hook(calls.before_forward, prepend=True),
                model.register_forward_hook(calls.after_forward),
            )
            leaving = _LEAVING_BY_EXCEPTION
            try:
                yield model
                leaving = _LEAVING
            finally:
                for hook in hooks:
                    hook.remove()
                calls.leave(leaving)
                if calls.out_of_step is not None:
                    self._out_of_step = _out_of_step_message(self.global_rank, calls.out_of_step)
                    if leaving == _LEAVING:  # the error was caught inside the block
                        self._refuse_out_of_step()

    def _meet_to_generate(self) -> None:
        self._refuse_out_of_step()
        group = self._generation_group
        if group is None:
            return
        try:
            dist.monitored_barrier(
                group, timeout=timedelta(seconds=self._meeting_timeout), wait_all_ranks=True
            )
        except RuntimeError as err:
            raise RuntimeError(
                f"SkrullFSDPStrategy.generating() on global rank {self.global_rank}: not every "
                f"rank entered the block within {self._meeting_timeout:g} s ({err}). The "
                "parameters are sharded, so each forward of generate all-gathers them from the "
                "other ranks, and a rank that generates alone would hang. Enter "
                "trainer.strategy.generating() and call generate on every rank (drop an `if "
                "trainer.is_global_zero:` guard around it; the prompts and max_new_tokens may "
                "differ) and log the output on rank 0 only; or raise "
                "SkrullFSDPStrategy.generation_timeout if a rank is merely slow. A timeout "
                "closes the gloo group's connections: after one, every later block of the run "
                "raises at once (with 'pair closure' or 'Connection closed by peer' above)."
            ) from err

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
        optimizer states (``ModelCheckpoint(save_weights_only=True)``).

        Lightning's ``ModelParallelStrategy`` asks ``torch.distributed.checkpoint`` for the
        optimizer states too, which fails on such a folder with "Missing key in checkpoint
        state_dict: optimizer_0.param_groups.0.lr"; Lightning's other strategies say what
        happened instead, and so does this one.

        Raises:
            KeyError: a fit resumed from a folder that holds the weights only.
        """
        folder = Path(checkpoint_path)
        if self.optimizers and folder.is_dir() and (folder / ".metadata").is_file():
            keys = FileSystemReader(folder).read_metadata().state_dict_metadata
            if not any(key.startswith("optimizer_") for key in keys):
                raise KeyError(
                    f"Trying to restore optimizer state but the checkpoint {str(folder)!r} "
                    "contains only the model, probably because ModelCheckpoint(save_weights_only"
                    "=True) wrote it. Resume from a checkpoint written without it, or start a "
                    "new fit from its weights: SkrullFSDPStrategy.consolidate_checkpoint(folder, "
                    "file) writes them as one file, which LightningModule.load_from_checkpoint "
                    "loads."
                )
        return super().load_checkpoint(checkpoint_path, *args, **kwargs)

    @staticmethod
    def consolidate_checkpoint(folder: str | Path, file: str | Path) -> None:
        """Write the checkpoint folder ``folder`` (``save_distributed_checkpoint=True``) as one
        Lightning checkpoint file ``file``, on one process without a process group.

        The file holds the full weights under ``state_dict`` (the LightningModule's keys) and
        Lightning's loop, callback and loader state from the folder's ``meta.pt``, so a plain
        ``LightningModule.load_from_checkpoint(file)`` loads it, on one process with no Skrull
        strategy. The optimizer states stay under ``optimizer_0``, ... as
        ``torch.distributed.checkpoint`` keyed them (by parameter name): to continue the run
        with its optimizer, resume from the folder.
        ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` alone leaves ``meta.pt``
        out (``load_from_checkpoint`` then fails on ``'pytorch-lightning_version'``),
        and Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` expects
        the weights under ``model``, as its ``FSDPStrategy`` writes them. Everything is read
        into host memory: the whole model and its optimizer states.
        """
        folder, file = Path(folder), Path(file)
        meta = folder / _METADATA_FILENAME
        if not meta.is_file():
            raise ValueError(
                f"{folder} is not a SkrullFSDPStrategy checkpoint folder: it has no "
                f"{_METADATA_FILENAME} (Lightning's loop state). Give the folder that "
                "trainer.save_checkpoint or ModelCheckpoint wrote with "
                "save_distributed_checkpoint=True."
            )
        checkpoint: dict[str, Any] = {}
        _load_state_dict(
            checkpoint,
            storage_reader=FileSystemReader(folder),
            planner=_EmptyStateDictLoadPlanner(),
            no_dist=True,
        )
        checkpoint.update(torch.load(meta, map_location="cpu", weights_only=False))
        torch.save(checkpoint, file)

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
