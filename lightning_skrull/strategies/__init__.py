"""The Lightning edge: strategies that run one Skrull global batch per optimizer step.

One strategy per file, as in Lightning: :mod:`.base` (the shared mixin), :mod:`.ddp`
(:class:`SkrullStrategy`) and :mod:`.deepspeed` (:class:`SkrullZero2Strategy`, ZeRO-2).
"""

from lightning_skrull.strategies.base import SkrullStrategyMixin
from lightning_skrull.strategies.ddp import SkrullStrategy
from lightning_skrull.strategies.deepspeed import SkrullZero2Strategy

__all__ = ["SkrullStrategy", "SkrullStrategyMixin", "SkrullZero2Strategy"]
