"""The step loop of the Skrull strategies: the LightningModule's step once per micro-batch.

:class:`MicroBatchRunner` runs a training step as Lightning's automatic optimization expects
one: all micro-batches but the last run forward and backward right there, without gradient sync
(the strategy's :meth:`~SkrullStrategyMixin._earlier_micro_batch_sync_context`); their
gradients are stashed away from Lightning's ``zero_grad`` and put back before Lightning's own
backward of the last micro-batch, whose loss the step returns and whose backward syncs the
gradients once. Each micro-batch runs inside its attention context; the last one's stays set
until Lightning's backward has run. Validation and test steps run every micro-batch forward.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, ExitStack
from typing import TYPE_CHECKING, Any, cast

import torch
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.memory import recursive_detach
from torch import Tensor

from lightning_skrull.data.batch import PlanStats, SkrullBatch
from lightning_skrull.data.collate import MicroBatch, RankBatch
from lightning_skrull.data.dataset import IGNORE_INDEX
from lightning_skrull.models.adapters import check_checkpointing_gradients
from lightning_skrull.models.chunked_loss import note_missing_logits
from lightning_skrull.models.token_loss import CUSTOM_LOSS_MESSAGE, CustomLossWarning
from lightning_skrull.runtime.engine import check_same_plan, micro_batch_context
from lightning_skrull.strategies.setup_checks import accumulation_message
from lightning_skrull.strategies.step_logging import StepLogs, combine_outputs

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_skrull.strategies.base import SkrullStrategyMixin


def _supervised_tokens(mb: MicroBatch) -> Tensor:
    """This rank's supervised tokens in ``mb``, as a 0-dim tensor (no host sync)."""
    return (mb.inputs["shift_labels"] != IGNORE_INDEX).sum()


def loss_of(output: Any, hook: str, index: int) -> Tensor | None:
    """The loss tensor of a step's ``output`` (a tensor, or a dict's ``"loss"``), or ``None``.

    Raises:
        TypeError: a ``training_step`` returned something else than ``None``, a tensor or a
            dict with a ``"loss"`` tensor.
    """
    if output is None:
        return None
    if isinstance(output, Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), Tensor):
        return output["loss"]
    if hook == "training_step":
        raise TypeError(
            f"training_step returned {type(output).__name__} for micro-batch {index}; return "
            "the loss tensor (or a dict with a 'loss' tensor)."
        )
    return None


def required_loss(output: Any, index: int) -> Tensor:
    """The loss of a ``training_step`` output (see :func:`loss_of`); ``None`` is refused."""
    loss = loss_of(output, "training_step", index)
    if loss is None:
        raise RuntimeError(
            f"training_step returned None for micro-batch {index}; skipping part of a global "
            "batch is not supported: every rank must run the same optimizer step."
        )
    return loss


class MicroBatchRunner:
    """Runs the LightningModule's step once per micro-batch of this rank's batch.

    Args:
        strategy: the strategy it runs for (read live: its model, precision plugin and
            optimizers are set up after the runner is made; its hooks differ per strategy).
    """

    def __init__(self, strategy: SkrullStrategyMixin) -> None:
        self._strategy = strategy
        self._stashed_grads: list[tuple[torch.nn.Parameter, Tensor]] = []
        self._last_context: ExitStack | None = None
        self.check_loss_rule = False
        """Warn about a loss of unknown normalisation in the next training step (the first
        of each fit)."""
        self.global_loss_out = False
        """Return the global loss's value (the learning-rate finder reads it), not this rank's
        share of it."""

    def note_callbacks(self, trainer: pl.Trainer) -> None:
        """Return the global loss from the training step under Lightning's learning-rate
        finder (``Tuner.lr_find`` fits with its callback, whose curve must be the global loss,
        not this rank's share of it); read at setup: while it searches, the finder swaps the
        Trainer's callbacks for its own ``_LRCallback``."""
        callbacks = cast(list[Any], getattr(trainer, "callbacks", []))
        self.global_loss_out = any(isinstance(c, LearningRateFinder) for c in callbacks)

    # ------------------------------------------------------------------ steps
    def training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The strategy's ``training_step``: every micro-batch, the step's loss returned."""
        strategy = self._strategy
        module = strategy.lightning_module
        trainer = module.trainer if module is not None else None
        if trainer is not None and trainer.accumulate_grad_batches != 1:  # set after setup
            factor = trainer.accumulate_grad_batches
            raise ValueError(accumulation_message(type(strategy).__name__, factor))
        strategy.step_logger.start_step()
        self.reset()
        trainable = strategy._trainable
        if trainable is not None and (change := trainable.change()) is not None:
            if strategy._hf_model is not None:  # embeddings frozen now: the setup's check again
                check_checkpointing_gradients(strategy._hf_model)
            strategy._follow_trainable_change(change)
        rank_batch, stats = self.as_rank_batch(args[0], "training_step")
        timer = None
        calibration = strategy._calibration
        if calibration is not None:
            calibration.begin_step(args[0])
            timer = calibration.timer
        self.check_plan(rank_batch)
        rest = args[1:]
        micro_batches = rank_batch.micro_batches
        if not micro_batches:
            raise RuntimeError(
                "this rank got no micro-batch for the step; every rank must run at least one "
                "forward and backward (the data module pads with an empty micro-batch)."
            )
        precision: Precision = strategy.precision_plugin
        earlier: list[Tensor] = []
        outputs: list[Any] = []
        last_index = len(micro_batches) - 1
        logs = strategy.step_logger.open(rank_batch)
        try:
            with precision.train_step_context():
                if earlier_count := last_index:
                    # start from clean gradients: Lightning zeroes only after the training step
                    self._clear_gradients()
                for i in range(earlier_count):
                    mb = micro_batches[i]
                    logs.start_micro_batch(_supervised_tokens(mb))
                    if timer is not None:
                        timer.start()
                    sync = strategy._earlier_micro_batch_sync_context()
                    with sync, self._micro_batch_context(mb):
                        output = self._call_module_step("training_step", mb, rest, kwargs)
                        loss = required_loss(output, i)
                        self._check_custom_loss(loss, logs)
                        self._earlier_micro_batch_backward(loss)
                    if timer is not None:
                        timer.stop()
                    earlier.append(loss.detach())
                    outputs.append(recursive_detach(output))
                if earlier:
                    self._stash_gradients()
                strategy._before_last_micro_batch()
                # the last micro-batch's context stays set until Lightning's backward has run
                # (activation checkpointing recomputes attention there)
                self._last_context = ExitStack()
                self._last_context.enter_context(self._micro_batch_context(micro_batches[-1]))
                logs.start_micro_batch(_supervised_tokens(micro_batches[-1]))
                if timer is not None and strategy._time_last_micro_batch:
                    timer.start()  # its end: the last gradient hook of Lightning's backward
                output = self._call_module_step("training_step", micro_batches[-1], rest, kwargs)
                last = required_loss(output, last_index)
                self._check_custom_loss(last, logs)
        finally:
            self.check_loss_rule = False  # the first step tells
            strategy.step_logger.close()
        logs.flush()
        # gradient flows through the last micro-batch only; the value is the rank's whole share
        share = last + torch.stack(earlier).sum() if earlier else last
        strategy.step_logger.log_step(rank_batch, stats, share.detach(), "train", logs.names)
        if self.global_loss_out and strategy.world_size > 1:
            # the same gradient, the value of the global loss: the learning-rate finder reads
            # the loss of each step from the returned value
            share = share + (strategy.reduce(share.detach(), reduce_op="mean") - share.detach())
        if isinstance(output, dict):
            combined = combine_outputs([*outputs, recursive_detach(output)], logs.is_model_loss)
            return {**combined, "loss": share}
        return share

    def eval_step(self, hook: str, stage: str, args: tuple[Any, ...], kwargs: Any) -> Any:
        """The strategy's ``validation_step`` / ``test_step``: every micro-batch forward."""
        strategy = self._strategy
        rank_batch, stats = self.as_rank_batch(args[0], hook)
        self.check_plan(rank_batch)
        rest = args[1:]
        precision: Precision = strategy.precision_plugin
        context = (
            precision.val_step_context() if stage == "validation" else precision.test_step_context()
        )
        losses: list[Tensor] = []
        outputs: list[Any] = []
        logs = strategy.step_logger.open(rank_batch)
        try:
            with context:
                for i, mb in enumerate(rank_batch.micro_batches):
                    logs.start_micro_batch(_supervised_tokens(mb))
                    with self._micro_batch_context(mb):
                        output = self._call_module_step(hook, mb, rest, kwargs)
                    outputs.append(output)
                    loss = loss_of(output, hook, i)
                    if loss is not None:
                        losses.append(loss.detach())
        finally:
            strategy.step_logger.close()
        logs.flush()
        if losses and len(losses) == len(rank_batch.micro_batches):
            share = torch.stack(losses).sum()
            name = getattr(args[0], "dataset_name", None)
            logger = strategy.step_logger
            logger.log_step(rank_batch, stats, share, stage, logs.names, dataset_name=name)
        return combine_outputs(outputs, logs.is_model_loss)

    def as_rank_batch(self, batch: Any, hook: str) -> tuple[RankBatch, PlanStats | None]:
        """``(rank batch, plan statistics or None)`` of a loader batch, or a clear TypeError."""
        if isinstance(batch, SkrullBatch):
            return batch.rank_batch, batch.stats
        if isinstance(batch, RankBatch):
            return batch, None
        raise TypeError(
            f"{type(self._strategy).__name__}.{hook} got a {type(batch).__name__} batch; it "
            "needs this rank's micro-batches of a global batch. Feed the Trainer a "
            "lightning_skrull.SkrullDataModule (or a loader that yields RankBatch objects from "
            "lightning_skrull.data.collate.collate_rank)."
        )

    def check_plan(self, rank_batch: RankBatch) -> None:
        """Check that every rank planned this batch alike (``verify_plans``), after refusing a
        step on a rank whose collectives fell out of step."""
        strategy = self._strategy
        strategy._refuse_out_of_step()  # before the step's first collective
        if not strategy.skrull_config.verify_plans or rank_batch.world_size == 1:
            return
        check_same_plan(
            rank_batch.plan,
            strategy.root_device,
            strategy.parallel_layout.world_group,
            fingerprint=rank_batch.fingerprint,
        )

    def _micro_batch_context(self, mb: MicroBatch) -> AbstractContextManager[Any]:
        strategy = self._strategy
        return micro_batch_context(
            mb, strategy.parallel_layout.cp_group, strategy.skrull_config.attention_backend
        )

    def _call_module_step(
        self, hook: str, mb: MicroBatch, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run the LightningModule's ``hook`` on one micro-batch (inside its context)."""
        strategy = self._strategy
        module = strategy._attached_module
        model = strategy.model
        try:
            if hook == "training_step" and model is not None and model is not module:
                # through the wrapper's forward, as Lightning does: DDP prepares its reducer there
                redirect = strategy._forward_redirection
                return redirect(model, module, hook, mb.inputs, *args, **kwargs)
            return getattr(module, hook)(mb.inputs, *args, **kwargs)
        except (TypeError, AttributeError) as error:
            if strategy._hf_model is not None:
                note_missing_logits(error, strategy._hf_model)  # logits=None: the chunked loss
            raise

    def _check_custom_loss(self, loss: Tensor, logs: StepLogs) -> None:
        """In the first training step of a fit, warn once (rank zero) when a micro-batch's loss
        is not known to follow the normalisation rule: neither the model's loss nor a
        ``token_mean_loss`` value, nor exactly equal to one (docs/loss.md, custom losses)."""
        zero = self._strategy.is_global_zero
        if self.check_loss_rule and zero and not logs.follows_loss_rule(loss):
            self.check_loss_rule = False
            warnings.warn(CUSTOM_LOSS_MESSAGE, CustomLossWarning, stacklevel=2)

    # ------------------------------------------------------------------ gradients
    def _earlier_micro_batch_backward(self, loss: Tensor) -> None:
        """Backward of an earlier micro-batch through the precision plugin, without hooks.

        Lightning's ``on_before_backward`` / ``on_after_backward`` belong to the step: they run
        once, around the last micro-batch's backward, which Lightning runs with the step's loss
        (the sum of the shares) and after which the step's whole gradient is in place. So this
        backward skips the plugin's ``pre_backward`` / ``post_backward`` (which call them) and
        applies only what ``pre_backward`` does to the tensor: the AMP loss scale (16-mixed).
        """
        strategy = self._strategy
        module = strategy._attached_module
        precision: Precision = strategy.precision_plugin
        optimizer = strategy.optimizers[0] if strategy.optimizers else None
        scaler = getattr(precision, "scaler", None)
        tensor = scaler.scale(loss) if scaler is not None else loss
        precision.backward(tensor, module, optimizer)

    def _stash_gradients(self) -> None:
        """Keep the earlier micro-batches' gradients away from Lightning's ``zero_grad``.

        Lightning's closure calls ``optimizer.zero_grad()`` after the training step and before
        the backward it runs itself; the stash moves the accumulated ``.grad`` tensors aside
        (no copy) and :meth:`restore_gradients` puts them back before the last micro-batch's
        backward.
        """
        module = self._strategy._attached_module
        self._stashed_grads = []
        for p in module.parameters():
            if p.grad is not None:
                self._stashed_grads.append((p, p.grad))
                p.grad = None

    def restore_gradients(self) -> None:
        """Put the stashed gradients back (added to any the parameters hold now)."""
        for p, grad in self._stashed_grads:
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.add_(grad)
        self._stashed_grads = []

    def _clear_gradients(self) -> None:
        for p in self._strategy._attached_module.parameters():
            p.grad = None

    def close_last_context(self) -> None:
        """Leave the last micro-batch's attention context (after Lightning's backward)."""
        if self._last_context is not None:
            context, self._last_context = self._last_context, None
            context.close()

    def reset(self) -> None:
        """Leave any open context and drop any stashed gradients (a new step, an exception,
        teardown)."""
        self.close_last_context()
        self._stashed_grads = []
