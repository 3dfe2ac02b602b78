"""The Lightning edge: strategies that run one Skrull global batch per optimizer step.

One strategy per file, as in Lightning: :mod:`.base` (the shared mixin), :mod:`.ddp`
(:class:`SkrullStrategy`) and :mod:`.deepspeed` (:class:`SkrullZero2Strategy`, ZeRO-2) and :mod:`.fsdp`
(:class:`SkrullFSDPStrategy`, FSDP2).
"""

from lightning_skrull.strategies.base import SkrullStrategyMixin
from lightning_skrull.strategies.ddp import SkrullStrategy
from lightning_skrull.strategies.deepspeed import SkrullZero2Strategy
from lightning_skrull.strategies.fsdp import SkrullFSDPStrategy

__all__ = [
    "SkrullFSDPStrategy",
    "SkrullStrategy",
    "SkrullStrategyMixin",
    "SkrullZero2Strategy",
]
