"""The Hugging Face model a Skrull strategy trains: found and prepared once at setup.

The strategy finds the model inside the LightningModule once per setup
(:func:`prepare_trained_model`); the step, the setup checks, the ``bucket_size="auto"`` probe
(:func:`probe_step`), generation, saving and the data module (:func:`plan_settings`, through
the strategy's ``plan_settings``) all use that one model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_skrull.config import AUTO_BUCKET, SkrullConfig
from lightning_skrull.data.batch import PlanSettings
from lightning_skrull.models.adapters import check_checkpointing_gradients
from lightning_skrull.models.families.vision_language import (
    image_token_id,
    is_multimodal,
    text_config,
)
from lightning_skrull.models.modes import train_mode_for_fit
from lightning_skrull.models.patching import find_hf_model, prepare_model
from lightning_skrull.runtime.memory import AutoBucket, ProbeStep
from lightning_skrull.runtime.process_groups import ParallelLayout
from lightning_skrull.scheduling import CostModel


def prepare_trained_model(module: nn.Module, config: SkrullConfig) -> tuple[nn.Module, CostModel]:
    """Find the HF model in the LightningModule, switch it to Skrull attention and check it.

    Returns:
        ``(model, cost model)``: the config's cost model, or one built from the model's config.
    """
    hf_model = find_hf_model(module, attribute=config.model_attribute)
    longest = None
    if isinstance(config.bucket_size, int):
        longest = config.cp_size * config.bucket_size
    prepare_model(
        hf_model,
        backend=config.attention_backend,
        max_sequence_length=longest,
        chunked_loss=config.chunked_loss,
        loss_kernel=config.loss_kernel,
    )
    check_checkpointing_gradients(hf_model)
    if config.cost_model is not None:
        return hf_model, config.cost_model
    return hf_model, CostModel.from_hf_config(text_config(hf_model.config))


def put_in_train_mode(hf_model: nn.Module, strategy: str) -> None:
    """Put a model that ``from_pretrained`` left in eval mode in training mode
    (:func:`~lightning_skrull.models.modes.train_mode_for_fit`), and say so on rank zero."""
    if train_mode_for_fit(hf_model):
        rank_zero_info(
            f"{strategy}: {type(hf_model).__name__} was in eval mode (as "
            "from_pretrained returns it); it trains in training mode, so activation "
            "checkpointing and everything else transformers does only in training apply."
        )


def plan_settings(config: SkrullConfig, hf_model: nn.Module | None) -> PlanSettings | None:
    """What the data module plans with and checks the data against; ``None`` before the model
    is found or while ``bucket_size`` is ``"auto"`` (measured late in the strategy's setup)."""
    if hf_model is None or config.bucket_size == AUTO_BUCKET:
        return None
    model_config: Any = hf_model.config
    vocab_size = getattr(text_config(model_config), "vocab_size", None)
    image = image_token_id(model_config) if is_multimodal(model_config) else None
    return PlanSettings(config=config, vocab_size=vocab_size, image_token_id=image)


def probe_step(
    hf_model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    layout: ParallelLayout,
    config: SkrullConfig,
    device: torch.device,
    autocast: Callable[[], AbstractContextManager[Any]],
) -> ProbeStep:
    """The ``bucket_size="auto"`` probe step of this rank (``autocast``: the precision
    plugin's training-step context)."""
    return ProbeStep(
        hf_model,
        optimizer,
        cp_rank=layout.cp_rank,
        cp_size=layout.cp_size,
        cp_group=layout.cp_group,
        backend=config.attention_backend,
        device=device,
        vocab_size=int(text_config(hf_model.config).vocab_size),
        autocast=autocast,
    )


def require_model(hf_model: nn.Module | None, call: str, when: str) -> nn.Module:
    """The prepared model, or a RuntimeError: ``call`` (``"Strategy.save_pretrained"``) needs
    the model the Trainer's setup prepares; ``when`` says where to call it."""
    if hf_model is None:
        raise RuntimeError(f"{call} needs the model the Trainer's setup prepares; {when}.")
    return hf_model


def model_to_generate(
    hf_model: nn.Module | None, strategy: str, in_micro_batches: bool
) -> nn.Module:
    """The model ``strategy.generating()`` yields, or a RuntimeError: inside a step's
    micro-batches (``in_micro_batches``), or before setup prepared the model."""
    if in_micro_batches:
        raise RuntimeError(
            f"{strategy}.generating() was entered inside a training/validation/"
            "test step, which runs once per micro-batch; generate from on_train_batch_end, "
            "on_validation_epoch_end or another hook that runs once per step or epoch."
        )
    when = "call it from a hook during trainer.fit / validate / test"
    return require_model(hf_model, f"{strategy}.generating()", when)


def log_auto_bucket(measured: AutoBucket, log: logging.Logger, *, rank: int) -> None:
    """Log the measured ``bucket_size="auto"`` on global rank 0 (with ``log``, the strategy's
    logger): the fitted line and the bucket, and a warning when the fit is not linear."""
    if rank != 0:
        return
    log.info(measured.describe())
    warning = measured.nonlinear_warning()
    if warning is not None:
        log.warning(warning)
