"""``skrull-finetune``: fine-tune a Hugging Face causal LM with Skrull from a YAML recipe.

A :class:`~lightning.pytorch.cli.LightningCLI` over the causal-LM module
(:class:`~lightning_skrull.causal_lm.SkrullCausalLM`) and
:class:`~lightning_skrull.SkrullDataModule`::

    skrull-finetune fit --config examples/configs/tiny_cpu.yaml
    skrull-finetune validate --config examples/configs/qwen2.5-0.5b.yaml --model.model /path/to/ckpt

Without ``--config`` the defaults are those of ``examples/configs/tiny_cpu.yaml``: a tiny
random-initialised Qwen2.5-architecture model on the bundled mixed-length dataset, 4 CPU
processes (DP=2 x CP=2). At the end of ``fit`` rank 0 prints the speed and the plan
statistics (:class:`PlanStatsPrinter`).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_only

from lightning_skrull.causal_lm import SkrullCausalLM
from lightning_skrull.data.batch import SkrullBatch
from lightning_skrull.data.datamodule import SkrullDataModule
from lightning_skrull.strategies.ddp import SkrullStrategy
from lightning_skrull.strategies.fsdp import SkrullFSDPStrategy

TINY_QWEN2_5: dict[str, Any] = {
    "model_type": "qwen2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
}
"""A Qwen2.5-architecture decoder small enough to train on a CPU (vocabulary of the bundled
dataset; GQA 4:2 and tied embeddings as in Qwen2.5-0.5B)."""


class PlanStatsPrinter(pl.Callback):
    """Prints, on rank 0 at the end of ``fit``, the speed and the plan statistics of the run."""

    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Record this step's logged statistics."""
        if not isinstance(batch, SkrullBatch):
            return
        metrics = trainer.callback_metrics
        row = {key: float(value) for key, value in metrics.items() if key.startswith("skrull/")}
        for key in ("tokens_per_s", "train_loss"):
            if key in metrics:
                row[key] = float(metrics[key])
        self.rows.append(row)

    @rank_zero_only
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the summary."""
        if not self.rows:
            return
        print(self.summary(trainer), flush=True)

    def summary(self, trainer: pl.Trainer) -> str:
        """The summary table as text."""

        def mean(key: str, rows: list[dict[str, float]]) -> float:
            values = [r[key] for r in rows if key in r]
            return sum(values) / len(values) if values else math.nan

        steady = self.rows[1:] or self.rows  # the first step includes warm-up
        strategy = trainer.strategy
        layout = ""
        if isinstance(strategy, SkrullStrategy) or hasattr(strategy, "parallel_layout"):
            layout = f"DP={strategy.dp_size} x CP={strategy.cp_size}, "  # type: ignore[attr-defined]
        lines = [
            f"Skrull run summary ({layout}{len(self.rows)} steps, policy "
            f"{getattr(strategy, 'skrull_config', None) and strategy.skrull_config.policy})",  # type: ignore[attr-defined]
            f"  tokens/s (mean after step 1)    {mean('tokens_per_s', steady):12.1f}",
            f"  tokens per step                 {mean('skrull/tokens', self.rows):12.1f}",
            f"  supervised tokens per step      {mean('skrull/supervised_tokens', self.rows):12.1f}",
            f"  share of sequences distributed  {mean('skrull/distributed_share', self.rows):12.3f}",
            f"  estimated plan imbalance        {mean('skrull/plan_imbalance', self.rows):12.3f}",
            f"  micro-batches per DP rank (max) {mean('skrull/micro_batches_max', self.rows):12.2f}",
            f"  micro-batches per DP rank (min) {mean('skrull/micro_batches_min', self.rows):12.2f}",
            f"  last train loss                 {self.rows[-1].get('train_loss', math.nan):12.4f}",
        ]
        return "\n".join(lines)


TINY_CPU_TRAINER: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 4,
    "strategy": {
        "class_path": "lightning_skrull.SkrullStrategy",
        "init_args": {"cp_size": 2, "bucket_size": 1024},
    },
    "max_epochs": 3,
    "log_every_n_steps": 1,
    "num_sanity_val_steps": 0,
    "enable_checkpointing": False,
    "logger": False,
}
"""Trainer settings of ``examples/configs/tiny_cpu.yaml`` (the CLI's defaults)."""


class SkrullCLI(LightningCLI):
    """LightningCLI with the Skrull data module, the causal-LM module and tiny CPU defaults."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """``fit``, ``validate`` and ``test``."""
        return {
            key: value
            for key, value in LightningCLI.subcommands().items()
            if key in ("fit", "validate", "test")
        }

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Defaults of the embedded tiny CPU recipe."""
        parser.set_defaults(
            {
                "model.model": TINY_QWEN2_5,
                "model.learning_rate": 3e-3,
                "data.train_data": "bundled:mixed_tiny",
                "data.global_batch_size": 32,
                "data.val_split": 32,
            }
        )

    def before_instantiate_classes(self) -> None:
        """Resolve ``model.load_on_rank_zero=None``: load on rank 0 only under
        :class:`~lightning_skrull.SkrullFSDPStrategy`, on every rank otherwise."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        if config.model.load_on_rank_zero is None:
            config.model.load_on_rank_zero = is_fsdp_strategy(config.trainer.strategy)


def is_fsdp_strategy(strategy: Any) -> bool:
    """Whether a Trainer ``strategy`` value (a registered name, a ``class_path`` config, a class
    or an instance) is :class:`~lightning_skrull.SkrullFSDPStrategy` or a subclass."""
    if isinstance(strategy, str):
        if strategy not in StrategyRegistry:
            return False
        strategy = StrategyRegistry[strategy]["strategy"]
    class_path = getattr(strategy, "class_path", None)
    if isinstance(strategy, dict):
        class_path = strategy.get("class_path")
    if isinstance(class_path, str):
        module_name, _, name = class_path.rpartition(".")
        if not module_name:
            return False  # jsonargparse resolves short names to full paths before this
        strategy = getattr(importlib.import_module(module_name), name, None)
    if isinstance(strategy, type):
        return issubclass(strategy, SkrullFSDPStrategy)
    return isinstance(strategy, SkrullFSDPStrategy)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``skrull-finetune`` (``args``: the command line, default ``sys.argv``)."""
    SkrullCLI(
        SkrullCausalLM,
        SkrullDataModule,
        trainer_defaults={**TINY_CPU_TRAINER, "callbacks": [PlanStatsPrinter()]},
        seed_everything_default=0,
        save_config_callback=None,
        args=args,
    )


if __name__ == "__main__":  # pragma: no cover
    main()
