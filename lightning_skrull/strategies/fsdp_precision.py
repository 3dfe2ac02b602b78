"""The precision of :class:`~lightning_skrull.strategies.fsdp.SkrullFSDPStrategy`: FSDP2's
``MixedPrecisionPolicy`` per Lightning ``precision``, the dtypes parameters are sharded in, and
gradient clipping by norm on DTensor gradients."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

FSDP_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true")
"""Lightning ``precision`` values the strategy runs (tested on CPU processes)."""

FLOAT_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)
"""Floating-point parameter dtypes whose frozen elements ranks compare before sharding."""


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


def as_fsdp_precision(plugin: Precision) -> FSDPPrecision:
    """``plugin`` itself if it is an :class:`FSDPPrecision`, else the one of its ``precision``.

    Raises:
        ValueError: a ``precision`` the strategy does not run (:data:`FSDP_PRECISIONS`).
    """
    if isinstance(plugin, FSDPPrecision):
        return plugin
    return FSDPPrecision(str(getattr(plugin, "precision", "32-true")))
