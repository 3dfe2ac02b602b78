"""``SkrullCausalLM``: the LightningModule of ``skrull-finetune``, causal-LM fine-tuning of a
Hugging Face model with its own loss.

It builds the model (a name or path, loaded on every rank or on rank 0 only, or a config dict
for random weights; LoRA adapters with peft; gpt-oss's MXFP4 experts dequantized), returns the
model's own loss from ``training_step``, logs token-level perplexity per validation set
(:class:`TokenPerplexity`) and steps AdamW with transformers' weight-decay groups
(:func:`decay_parameter_names`) and learning-rate schedules. Nothing in it knows the Skrull
strategies: the CLI (:mod:`lightning_skrull.cli`) puts it under one, and so can any Trainer.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any, Literal, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torchmetrics import Metric

from lightning_skrull.data.dataset import IGNORE_INDEX
from lightning_skrull.models.adapters import apply_lora
from lightning_skrull.models.loading import auto_model_class, from_pretrained_on_rank_zero

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict
    from transformers import PreTrainedModel


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
            dict (``model_type`` plus fields, e.g. :data:`~lightning_skrull.cli.TINY_QWEN2_5`) for a randomly
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
