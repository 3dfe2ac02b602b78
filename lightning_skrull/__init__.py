"""lightning-skrull: Skrull data scheduling (DACP + GDS) for long-context SFT in Lightning.

Importing the package registers the strategy names ``"skrull"``, ``"skrull_spawn"``,
``"skrull_cp2"``, ``"skrull_cp4"``, ``"skrull_cp8"``, ``"skrull_zero2"``, ``"skrull_fsdp"`` and
``"skrull_fsdp_world"`` with Lightning's
strategy registry, so ``Trainer(strategy="skrull")`` works after ``import lightning_skrull``.
"""

from __future__ import annotations

from lightning_skrull.callbacks import PlanPictureCallback
from lightning_skrull.config import DataConfig, SkrullConfig
from lightning_skrull.data.batch import SkrullBatch
from lightning_skrull.data.datamodule import SkrullDataModule
from lightning_skrull.models.token_loss import CustomLossWarning, shifted_labels, token_mean_loss
from lightning_skrull.scheduling import CostModel, plan_global_batch, simulate
from lightning_skrull.strategies.ddp import SkrullStrategy
from lightning_skrull.strategies.deepspeed import SkrullZero2Strategy
from lightning_skrull.strategies.fsdp import SkrullFSDPStrategy

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "CustomLossWarning",
    "DataConfig",
    "PlanPictureCallback",
    "SkrullBatch",
    "SkrullConfig",
    "SkrullDataModule",
    "SkrullFSDPStrategy",
    "SkrullStrategy",
    "SkrullZero2Strategy",
    "__version__",
    "plan_global_batch",
    "register_strategies",
    "shifted_labels",
    "simulate",
    "token_mean_loss",
]


def register_strategies() -> None:
    """Register the Skrull strategy names with Lightning (done once, at import)."""
    from lightning.pytorch.strategies import StrategyRegistry

    for cls in (SkrullStrategy, SkrullZero2Strategy, SkrullFSDPStrategy):
        if getattr(cls, "strategy_name", None) not in StrategyRegistry:
            cls.register_strategies(StrategyRegistry)


register_strategies()
