"""``skrull-finetune``: fine-tune a Hugging Face causal LM with Skrull from a YAML recipe.

A :class:`~lightning.pytorch.cli.LightningCLI` over :class:`SkrullCausalLM` and
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
import re
from typing import TYPE_CHECKING, Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from torchmetrics import Metric

from lightning_skrull.data.batch import SkrullBatch
from lightning_skrull.data.datamodule import SkrullDataModule
from lightning_skrull.data.dataset import IGNORE_INDEX
from lightning_skrull.models.adapters import apply_lora
from lightning_skrull.models.loading import auto_model_class, from_pretrained_on_rank_zero
from lightning_skrull.strategies.ddp import SkrullStrategy
from lightning_skrull.strategies.fsdp import SkrullFSDPStrategy

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict
    from transformers import PreTrainedModel

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


class TokenPerplexity(Metric):
    """Perplexity over every supervised token, summed over micro-batches, steps and ranks.

    ``update(loss, num_items, num_tokens)`` takes a micro-batch's loss as the model returns it
    (token-loss sum over ``num_items``) and the micro-batch's supervised tokens. The states are
    sums reduced over all processes, so the result is ``exp(total token loss / total tokens)``,
    exactly what one process computes on the whole validation set.
    """

    full_state_update = False
    higher_is_better = False

    nll_sum: torch.Tensor
    tokens: torch.Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("nll_sum", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("tokens", torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, loss: torch.Tensor, num_items: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Add one micro-batch (``loss`` = its token-loss sum / ``num_items``)."""
        self.nll_sum += loss.detach().double() * num_items.detach().double()
        self.tokens += num_tokens.detach().double()

    def compute(self) -> torch.Tensor:
        """``exp`` of the mean token loss (``nan`` before any supervised token)."""
        if self.tokens == 0:
            return torch.tensor(float("nan"), dtype=torch.float64)
        return torch.exp(self.nll_sum / self.tokens)


class SkrullCausalLM(pl.LightningModule):
    """Causal-LM fine-tuning: the loss is the Hugging Face model's own.

    Args:
        model: a Hugging Face model name or path (loaded with ``from_pretrained``), or a config
            dict (``model_type`` plus fields, e.g. :data:`TINY_QWEN2_5`) for a randomly
            initialised model.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay, of every trainable weight but biases and
            normalisation weights (as transformers' ``Trainer`` groups them), unless
            ``decay_norms_and_biases``.
        betas: AdamW betas.
        warmup_steps: linear warm-up steps of the learning rate.
        lr_schedule: the learning rate after the warm-up, per optimizer step: ``"constant"``
            (the warm-up multiplies step ``s`` by ``min(1, (s + 1) / warmup_steps)``), or
            ``"linear"`` / ``"cosine"``, transformers' ``get_linear_schedule_with_warmup`` /
            ``get_cosine_schedule_with_warmup`` (what ``lr_scheduler_type`` picks in
            transformers' ``Trainer``), decaying to 0 over the fit's optimizer steps
            (``trainer.estimated_stepping_batches``: the global batches of ``max_epochs``
            epochs, or ``max_steps``).
        torch_dtype: dtype to load the weights in (``"bfloat16"``, ``"float32"``; ``None``: the
            checkpoint's).
        gradient_checkpointing: recompute activations in backward (long sequences).
        load_on_rank_zero: for a name or path, read the weights on global rank 0 only and build
            the model on the meta device on the other ranks
            (:func:`~lightning_skrull.models.from_pretrained_on_rank_zero`), so the job holds
            one full copy on rank 0's host instead of one per process. Only
            :class:`~lightning_skrull.SkrullFSDPStrategy` can start from such a model (it fills
            every rank's shards from rank 0); the other strategies refuse it at setup. ``None``:
            ``skrull-finetune`` sets it to whether the Trainer's strategy is
            ``SkrullFSDPStrategy``; outside the CLI, ``False``. A config dict ignores it (every
            rank initialises the same random weights from the seed).
        lora: train LoRA adapters instead of every weight: the arguments of peft's
            ``LoraConfig`` (``r``, ``lora_alpha``, ``target_modules``, ...; ``task_type``
            defaults to ``"CAUSAL_LM"``), applied with ``get_peft_model`` once the model is
            built; ``self.model`` is then the ``PeftModel``, and only the adapters train. Keep
            ``lm_head`` out of ``target_modules`` under the chunked loss (docs/models.md).
            Needs peft (``pip install "lightning-skrull[peft]"``). ``None``: full fine-tuning.
        decay_norms_and_biases: apply ``weight_decay`` to biases and normalisation weights too
            (one parameter group); by default they form a second group without decay.
        dequantize_mxfp4: load a checkpoint whose experts are stored in MXFP4 (gpt-oss; its
            ``config.json`` has ``quantization_config.quant_method: mxfp4``) dequantized to
            ``torch_dtype``, with ``from_pretrained(..., quantization_config=Mxfp4Config(
            dequantize=True))``: where transformers' MXFP4 kernels are installed (CUDA with the
            ``kernels`` package) it otherwise loads packed ``uint8`` experts, which cannot be
            trained and are refused at setup (docs/models.md, "gpt-oss").

    Raises:
        ValueError: a config dict without ``model_type``, a bad number, ``lora`` arguments
            that are not a causal-LM ``LoraConfig``, or ``dequantize_mxfp4`` for a config dict
            or a checkpoint that is not MXFP4-quantized.
        TypeError: ``model`` is neither a string nor a dict.
        ImportError: ``lora`` is given and peft is not installed.
    """

    def __init__(
        self,
        model: str | dict[str, Any],
        learning_rate: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 0,
        lr_schedule: Literal["constant", "linear", "cosine"] = "constant",
        torch_dtype: str | None = None,
        gradient_checkpointing: bool = False,
        load_on_rank_zero: bool | None = None,
        lora: dict[str, Any] | None = None,
        dequantize_mxfp4: bool = False,
        decay_norms_and_biases: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(model, (str, dict)):
            raise TypeError(
                f"model must be a Hugging Face name or path (str) or a config dict for random "
                f"initialisation, got {type(model).__name__}."
            )
        if not learning_rate > 0:
            raise ValueError(f"learning_rate must be > 0, got {learning_rate}.")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}.")
        if lr_schedule not in LR_SCHEDULES:
            raise ValueError(
                f"lr_schedule must be one of {', '.join(map(repr, LR_SCHEDULES))}, got "
                f"{lr_schedule!r}."
            )
        self.save_hyperparameters()
        hf_model = self._build_model(
            model, torch_dtype, bool(load_on_rank_zero), dequantize_mxfp4=dequantize_mxfp4
        )
        if gradient_checkpointing:
            hf_model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        self.model: torch.nn.Module = hf_model if lora is None else apply_lora(hf_model, lora)
        self.val_perplexity = TokenPerplexity()
        # one per validation loader when there are several (built when validation starts)
        self.val_perplexities = torch.nn.ModuleList()
        self._val_loaders = 1
        self._val_ppl_names: tuple[str, ...] = ()

    @staticmethod
    def _build_model(
        model: str | dict[str, Any],
        torch_dtype: str | None,
        load_on_rank_zero: bool,
        *,
        dequantize_mxfp4: bool = False,
    ) -> PreTrainedModel:
        from transformers import AutoConfig

        dtype = getattr(torch, torch_dtype) if torch_dtype else None
        if isinstance(model, str):
            config = AutoConfig.from_pretrained(model)
            kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
            if dequantize_mxfp4:
                kwargs["quantization_config"] = _mxfp4_dequantization(model, config)
            if load_on_rank_zero:
                return from_pretrained_on_rank_zero(model, **kwargs)
            # a vision-language checkpoint loads as its ...ForConditionalGeneration class
            auto_class = auto_model_class(config)
            return auto_class.from_pretrained(model, **kwargs)  # type: ignore[no-any-return]
        if dequantize_mxfp4:
            raise ValueError(
                "dequantize_mxfp4=True needs a checkpoint (a name or path) whose experts are "
                "stored in MXFP4; a config dict builds random weights with nothing to dequantize. "
                "Drop dequantize_mxfp4."
            )
        fields = dict(model)
        model_type = fields.pop("model_type", None)
        if model_type is None:
            raise ValueError(
                f"a model config dict needs a 'model_type' (e.g. 'qwen2'); got keys {sorted(fields)}."
            )
        hf_config = AutoConfig.for_model(model_type, **fields)
        built = auto_model_class(hf_config).from_config(hf_config)
        return built.to(dtype) if dtype is not None else built

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The model's loss on this micro-batch (the strategy sums the rank's share)."""
        return self.model(**batch).loss

    def on_validation_start(self) -> None:
        """One perplexity metric per validation loader, named like the strategy's loss:
        ``val_ppl/<name>`` for the named sets of ``SkrullDataModule(val_data={name: ...})``,
        ``val_ppl`` for one unnamed set (Lightning adds ``/dataloader_idx_N`` to it for
        several unnamed loaders)."""
        trainer = self.trainer
        count = len(trainer.num_val_batches)
        datamodule = getattr(trainer, "datamodule", None)
        names = tuple(getattr(datamodule, "val_set_names", ()))
        self._val_loaders = count
        self._val_ppl_names = names if len(names) == count else ()
        if count > 1 and len(self.val_perplexities) != count:
            metrics = [TokenPerplexity() for _ in range(count)]
            self.val_perplexities = torch.nn.ModuleList(metrics).to(self.device)

    def validation_step(
        self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0
    ) -> torch.Tensor:
        """The loss, and token-level perplexity through torchmetrics (one per validation set)."""
        loss = self.model(**batch).loss
        tokens = (batch["shift_labels"] != IGNORE_INDEX).sum()
        several = self._val_loaders > 1
        metric = self.val_perplexity
        if several:
            metric = cast("TokenPerplexity", self.val_perplexities[dataloader_idx])
        metric.update(loss, batch["num_items_in_batch"], tokens)
        named = bool(self._val_ppl_names)
        self.log(
            f"val_ppl/{self._val_ppl_names[dataloader_idx]}" if named else "val_ppl",
            metric,
            on_step=False,
            on_epoch=True,
            prog_bar=True,
            add_dataloader_idx=not named,
            metric_attribute=f"val_perplexities.{dataloader_idx}" if several else "val_perplexity",
        )
        return loss

    def configure_optimizers(self) -> Any:
        """AdamW over the trainable parameters (the adapters under ``lora``), with the
        learning-rate schedule of ``warmup_steps`` and ``lr_schedule``, stepped per optimizer
        step.

        Raises:
            ValueError: ``lr_schedule`` decays over a fit without a finite number of steps
                (``max_epochs=-1`` and no ``max_steps``).
        """
        hp = cast("AttributeDict", self.hparams)  # save_hyperparameters() made it one
        trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
        # absent from older checkpoints, which decayed every weight (and resume with one group)
        if hp.weight_decay and not hp.get("decay_norms_and_biases", True):
            decayed = set(decay_parameter_names(self))
            groups: list[dict[str, Any]] = [
                {"params": [p for n, p in trainable if n in decayed]},
                {"params": [p for n, p in trainable if n not in decayed], "weight_decay": 0.0},
            ]
            params: Any = [g for g in groups if g["params"]]
        else:
            params = [p for _, p in trainable]
        optimizer = torch.optim.AdamW(
            params, lr=hp.learning_rate, weight_decay=hp.weight_decay, betas=hp.betas
        )
        warmup = int(hp.warmup_steps)
        schedule = hp.get("lr_schedule", "constant")  # absent from older checkpoints
        if schedule == "constant":
            if not warmup:
                return optimizer
            scheduler: Any = torch.optim.lr_scheduler.LambdaLR(
                optimizer, lambda step: min(1.0, (step + 1) / warmup)
            )
        else:
            scheduler = _decaying_schedule(optimizer, schedule, warmup, self.trainer)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


NO_DECAY_NAME_PATTERNS = (
    r"bias",
    r"layernorm",
    r"rmsnorm",
    r"(?:^|\.)norm(?:$|\.)",
    r"_norm(?:$|\.)",
)
"""Parameter names (lower-cased) that get no weight decay: transformers' ``Trainer`` rule."""


def decay_parameter_names(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s parameters that weight decay applies to, as transformers'
    ``Trainer.get_decay_parameter_names`` picks them: every parameter but those inside a
    ``torch.nn.LayerNorm`` and those whose name matches :data:`NO_DECAY_NAME_PATTERNS` (biases,
    RMSNorm and other normalisation weights)."""
    patterns = [re.compile(p) for p in NO_DECAY_NAME_PATTERNS]
    inside_layer_norms = {
        id(p) for m in module.modules() if isinstance(m, torch.nn.LayerNorm) for p in m.parameters()
    }
    return [
        name
        for name, p in module.named_parameters()
        if id(p) not in inside_layer_norms and not any(r.search(name.lower()) for r in patterns)
    ]


LR_SCHEDULES = ("constant", "linear", "cosine")
"""What :class:`SkrullCausalLM`'s ``lr_schedule`` takes."""


def _decaying_schedule(optimizer: Any, schedule: str, warmup: int, trainer: pl.Trainer) -> Any:
    """transformers' linear or cosine schedule with ``warmup`` steps, decaying to 0 over the
    fit's optimizer steps."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    total = trainer.estimated_stepping_batches
    if not math.isfinite(total):
        raise ValueError(
            f"lr_schedule={schedule!r} decays the learning rate over the fit's optimizer steps, "
            "but this fit has no end (max_epochs=-1 and no max_steps). Set trainer.max_steps "
            "or trainer.max_epochs, or use lr_schedule='constant'."
        )
    if int(total) <= warmup:  # a short trial of a recipe, say: transformers' schedule as is
        rank_zero_warn(
            f"lr_schedule={schedule!r}: the fit runs {int(total)} optimizer steps, within "
            f"warmup_steps={warmup}, so the learning rate only warms up."
        )
    build = (
        get_cosine_schedule_with_warmup if schedule == "cosine" else get_linear_schedule_with_warmup
    )
    return build(optimizer, warmup, int(total))


def _mxfp4_dequantization(name_or_path: str, config: Any) -> Any:
    """``Mxfp4Config(dequantize=True)`` for a checkpoint whose config says its weights are
    MXFP4; a ValueError naming what it says otherwise."""
    from transformers.utils.quantization_config import Mxfp4Config

    quantization = getattr(config, "quantization_config", None)
    method = (
        quantization.get("quant_method")
        if isinstance(quantization, dict)
        else getattr(quantization, "quant_method", None)
    )
    if str(method) != "mxfp4":
        raise ValueError(
            f"dequantize_mxfp4=True, but {name_or_path!r} is not an MXFP4-quantized checkpoint: "
            f"its config.json has quantization_config.quant_method={method!r}, not 'mxfp4' "
            "(gpt-oss's released checkpoints are). Its weights load as they are stored: drop "
            "dequantize_mxfp4."
        )
    return Mxfp4Config(dequantize=True)


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
