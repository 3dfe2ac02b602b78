"""Lightning's ``self.log`` and step outputs when one step runs several micro-batches.

The Skrull strategies run the LightningModule's ``training_step`` (``validation_step``,
``test_step``) once per micro-batch, and DP ranks run different numbers of micro-batches in one
step. Lightning syncs an on-step value logged with ``sync_dist=True`` at the call itself, a
collective: called a different number of times on each rank, the calls do not pair up and the
run hangs. So while the micro-batches of a step run, :class:`StepLogs` stands in for the
module's ``log``: it records each call, and after the last micro-batch it logs each name
**once**, combined over the step, on every rank alike.

How a name's micro-batch values are combined (this rank's ``k`` micro-batches, ``w_i`` the
supervised tokens of micro-batch ``i`` on this rank, ``T`` those of the whole global batch over
every rank, ``W`` the DP x CP world size):

- **the model's loss** (the tensor the Hugging Face model returned as ``.loss`` in that
  micro-batch, or one :func:`~lightning_skrull.models.token_loss.token_mean_loss` returned;
  detached or not, or its ``.item()``): a pre-normalised share, so the shares are summed. With ``sync_dist`` Lightning's mean over the ranks is then the global token mean,
  exactly what one process logs for the whole global batch.
- ``reduce_fx="sum"``: summed; ``"max"`` / ``"min"``: the largest / smallest.
- any other value with ``reduce_fx="mean"`` (the default): the token-weighted mean
  ``sum_i w_i v_i / sum_i w_i`` (micro-batches without supervised tokens do not count). With
  ``sync_dist`` it is logged as ``W / T * sum_i w_i v_i``, so that Lightning's unweighted mean
  over the ranks is the token-weighted mean over the global batch. A user ``batch_size`` replaces
  the token weights (and then the ranks are averaged unweighted, as Lightning does); so does a
  ``sync_dist_group`` other than the world.
- ``torchmetrics`` objects accumulate their own state in every micro-batch; the step logs the
  object once, as Lightning does.

Each combined value is logged with ``batch_size=T`` (or the sum of the user's batch sizes), so
Lightning's epoch-level weighted mean is a token mean too, and Lightning never has to infer a
batch size from a Skrull batch.

:class:`StepLogger` is the strategy's side: it opens and closes a step's :class:`StepLogs`,
logs the exact loss of each global batch, the plan statistics and the throughput.
"""

from __future__ import annotations

import inspect
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from lightning_skrull.data.batch import LOSS_KEYS, PlanStats
from lightning_skrull.data.collate import RankBatch
from lightning_skrull.models.token_loss import observe_token_mean_losses

if TYPE_CHECKING:
    from lightning_skrull.strategies.base import SkrullStrategyMixin

_LOG_PARAMETERS: tuple[str, ...] = (
    "name",
    "value",
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "reduce_fx",
    "enable_graph",
    "sync_dist",
    "sync_dist_group",
    "add_dataloader_idx",
    "batch_size",
    "metric_attribute",
    "rank_zero_only",
)
"""``LightningModule.log``'s parameters, in order (checked against Lightning at import)."""

_LOG_DEFAULTS: dict[str, Any] = {
    "prog_bar": False,
    "logger": None,
    "on_step": None,
    "on_epoch": None,
    "reduce_fx": "mean",
    "enable_graph": False,
    "sync_dist": False,
    "sync_dist_group": None,
    "add_dataloader_idx": True,
    "batch_size": None,
    "metric_attribute": None,
    "rank_zero_only": False,
}


def _check_log_signature() -> None:
    from lightning.pytorch import LightningModule

    names = tuple(inspect.signature(LightningModule.log).parameters)[1:]
    if names != _LOG_PARAMETERS:  # pragma: no cover - a Lightning release changed self.log
        raise ImportError(
            f"lightning_skrull supports LightningModule.log{_LOG_PARAMETERS}, but the installed "
            f"Lightning has log{names}; install the Lightning version this release supports."
        )


_check_log_signature()


def _reduction(reduce_fx: Any) -> str:
    """``"mean"``, ``"sum"``, ``"max"`` or ``"min"`` for Lightning's accepted ``reduce_fx``."""
    for name in ("mean", "sum", "max", "min"):
        if reduce_fx == name or reduce_fx is getattr(torch, name):
            return name
    raise ValueError(
        f"self.log(..., reduce_fx={reduce_fx!r}) cannot be combined over the micro-batches of a "
        "Skrull step; use 'mean', 'sum', 'max' or 'min' (or torch.mean / sum / max / min)."
    )


@dataclass
class _Logged:
    """The calls of one name in one step."""

    kwargs: dict[str, Any]
    values: list[Any] = field(default_factory=list)
    micro_batches: list[int] = field(default_factory=list)
    is_loss: list[bool] = field(default_factory=list)
    batch_sizes: list[int | None] = field(default_factory=list)


class StepLogs:
    """Records a LightningModule's ``self.log`` calls over one step's micro-batches.

    Use: :meth:`start_micro_batch` before each micro-batch, :meth:`add_model_loss` for the loss
    the model returned in it, :meth:`record` as the module's ``log``, then :meth:`flush` once.

    Args:
        log: the module's real ``log`` (called by :meth:`flush`, once per name).
        world_size: ranks over which ``sync_dist`` averages (``dp_size * cp_size``).
        global_tokens: supervised tokens of the whole global batch (``T``).
    """

    def __init__(self, log: Callable[..., None], *, world_size: int, global_tokens: int) -> None:
        self._log = log
        self._world_size = world_size
        self._global_tokens = max(global_tokens, 1)
        self._logged: dict[str, _Logged] = {}
        self._weights: list[Tensor] = []
        self._losses: list[Tensor] = []
        self._step_losses: list[Tensor] = []

    @property
    def names(self) -> tuple[str, ...]:
        """The names logged in this step."""
        return tuple(self._logged)

    def start_micro_batch(self, supervised_tokens: Tensor) -> None:
        """Begin the next micro-batch; ``supervised_tokens`` is its count on this rank (0-dim)."""
        self._weights.append(supervised_tokens)
        self._losses = []

    def add_model_loss(self, loss: Tensor) -> None:
        """Note a loss the model (or :func:`token_mean_loss`) returned in the current
        micro-batch (recognised in logs)."""
        self._losses.append(loss)
        self._step_losses.append(loss)

    def is_model_loss(self, value: Any) -> bool:
        """Whether ``value`` is a loss the model returned in any micro-batch of the step."""
        return _is_one_of(value, self._step_losses)

    def _is_model_loss(self, value: Any) -> bool:
        return _is_one_of(value, self._losses)

    def follows_loss_rule(self, loss: Tensor) -> bool:
        """Whether the current micro-batch's ``loss`` is known to be normalised by the rule of
        docs/loss.md: one of the micro-batch's model losses (or :func:`token_mean_loss` values),
        or a tensor exactly equal to one (``out.loss * 1.0``, ``out.loss.clone()``). The
        comparison by value reads the tensors on the host."""
        if self._is_model_loss(loss):
            return True
        value = loss.detach().reshape(-1)
        return any(
            torch.equal(value, known.detach().reshape(-1).to(value.device, value.dtype))
            for known in self._losses
            if known.numel() == value.numel()
        )

    def record(self, *args: Any, **kwargs: Any) -> None:
        """Stand-in for ``LightningModule.log`` (same signature) during the micro-batches."""
        bound = dict(zip(_LOG_PARAMETERS, args, strict=False))
        overlap = set(bound) & set(kwargs)
        if overlap:
            raise TypeError(f"self.log() got multiple values for {sorted(overlap)}")
        bound.update(kwargs)
        unknown = set(bound) - set(_LOG_PARAMETERS)
        if unknown:
            raise TypeError(f"self.log() got unexpected keyword arguments {sorted(unknown)}")
        name, value = bound.pop("name"), bound.pop("value")
        options = {**_LOG_DEFAULTS, **bound}
        if not self._weights:
            raise RuntimeError("StepLogs.record called before start_micro_batch")
        entry = self._logged.get(name)
        if entry is None:
            entry = self._logged[name] = _Logged(kwargs=options)
        entry.values.append(value)
        entry.micro_batches.append(len(self._weights) - 1)
        entry.is_loss.append(self._is_model_loss(value))
        entry.batch_sizes.append(options["batch_size"])

    def flush(self) -> None:
        """Log every recorded name once, combined over the step (see the module docstring)."""
        for name, entry in self._logged.items():
            value, batch_size = self._combine(name, entry)
            kwargs = {**entry.kwargs, "batch_size": batch_size}
            self._log(name, value, **kwargs)

    def _combine(self, name: str, entry: _Logged) -> tuple[Any, int]:
        from torchmetrics import Metric

        last = entry.values[-1]
        if isinstance(last, Metric):
            return last, self._global_tokens
        if any(isinstance(v, Metric) for v in entry.values):
            raise TypeError(
                f"self.log({name!r}, ...) got a torchmetrics Metric in some micro-batches and a "
                "value in others; log one kind per name."
            )
        values = [torch.as_tensor(v).detach() for v in entry.values]
        for v in values:
            if v.numel() != 1:
                raise ValueError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(v.shape)}; Lightning "
                    "logs scalars only: reduce it (e.g. .mean()) before logging."
                )
        device = values[-1].device
        stacked = torch.stack([v.reshape(()).to(device, torch.float64) for v in values])
        reduction = _reduction(entry.kwargs["reduce_fx"])
        user_sizes = [b for b in entry.batch_sizes if b is not None]
        batch_size = sum(user_sizes) if user_sizes else self._global_tokens
        if reduction == "max":
            return stacked.max(), batch_size
        if reduction == "min":
            return stacked.min(), batch_size
        if reduction == "sum" or (reduction == "mean" and all(entry.is_loss)):
            return stacked.sum(), batch_size
        if user_sizes:
            weights = torch.tensor(
                [float(b) if b is not None else 0.0 for b in entry.batch_sizes],
                dtype=torch.float64,
                device=device,
            )
        else:
            weights = torch.stack(
                [self._weights[i].to(device, torch.float64) for i in entry.micro_batches]
            )
        counted = weights > 0
        weighted_sum = torch.where(counted, weights * stacked, 0.0).sum()
        total = weights.sum()
        rank_mean = torch.where(total > 0, weighted_sum / total.clamp_min(1e-300), stacked.mean())
        scale_over_ranks = (
            entry.kwargs["sync_dist"]
            and not entry.kwargs["rank_zero_only"]
            and entry.kwargs["sync_dist_group"] is None
            and not user_sizes
        )
        if scale_over_ranks:
            return weighted_sum * (self._world_size / self._global_tokens), batch_size
        return rank_mean, batch_size


def _is_one_of(value: Any, losses: list[Tensor]) -> bool:
    """Whether ``value`` is one of ``losses`` (the tensor, a detached view of it, or its value
    as a Python number)."""
    for loss in losses:
        if isinstance(value, Tensor):
            if value.numel() == 1 and value.data_ptr() == loss.data_ptr():
                return True
        elif isinstance(value, numbers.Real) and not isinstance(value, bool) and loss.numel() == 1:
            if float(value) == float(loss.detach()):
                return True
    return False


def combine_outputs(outputs: list[Any], is_model_loss: Callable[[Any], bool]) -> Any:
    """One step output from the micro-batches' outputs, as one process would return it.

    Model losses (pre-normalised shares) are summed, key by key in dicts; every other value
    becomes the list of the micro-batches' values. ``None`` everywhere gives ``None``.
    """
    if all(o is None for o in outputs):
        return None
    if all(isinstance(o, Tensor) for o in outputs) and all(is_model_loss(o) for o in outputs):
        return torch.stack([o.reshape(()) for o in outputs]).sum()
    if all(isinstance(o, dict) for o in outputs):
        keys = list(dict.fromkeys(k for o in outputs for k in o))
        return {k: combine_outputs([o.get(k) for o in outputs], is_model_loss) for k in keys}
    return list(outputs)


class StepLogger:
    """The strategy's logging of each step: a :class:`StepLogs` while the micro-batches run, the
    exact loss of the global batch, the plan statistics and the throughput.

    Args:
        strategy: the strategy whose LightningModule logs (read live: the module is attached
            and the model found at setup).
    """

    def __init__(self, strategy: SkrullStrategyMixin) -> None:
        self._strategy = strategy
        self._loss_hook: RemovableHandle | None = None
        self._token_loss_hook: RemovableHandle | None = None
        self.in_micro_batches = False
        """Whether a step's micro-batches are running (between :meth:`open` and :meth:`close`)."""
        self._step_start: float | None = None
        self._step_tokens = 0

    def refuse_collective(self, collective: str) -> None:
        """Refuse a collective (``strategy.reduce``, ...) while a step's micro-batches run.

        Raises:
            RuntimeError: inside the micro-batches; the message names the fix.
        """
        if self.in_micro_batches:
            raise RuntimeError(
                f"{collective} was called while {type(self._strategy).__name__} runs a step's "
                "micro-batches (the LightningModule's training/validation/test_step runs once "
                "per micro-batch, and DP ranks run different numbers of them), so the collective "
                "would not pair up across ranks and the run would hang. Log with "
                "self.log(..., sync_dist=True) instead (synced once per step), or gather in "
                "on_train_batch_end / on_validation_batch_end / an on_*_epoch_end hook."
            )

    def start_step(self) -> None:
        """Note the training step's start (its throughput is logged after the optimizer step)."""
        self._step_start = time.perf_counter()

    def open(self, rank_batch: RankBatch) -> StepLogs:
        """Stand in for the module's ``self.log`` while this step's micro-batches run, note the
        model's loss of each micro-batch, and refuse collectives from user code meanwhile."""
        module = self._strategy._attached_module
        logs = StepLogs(
            module.log,
            world_size=rank_batch.world_size,
            global_tokens=rank_batch.num_supervised_tokens,
        )

        def note_loss(_: torch.nn.Module, __: Any, output: Any) -> None:
            loss = getattr(output, "loss", None)
            if isinstance(loss, Tensor):
                logs.add_model_loss(loss)

        model = self._strategy._hf_model
        self._loss_hook = None if model is None else model.register_forward_hook(note_loss)
        self._token_loss_hook = observe_token_mean_losses(logs.add_model_loss)
        # an instance attribute shadows the method until closed
        module.__dict__["log"] = logs.record
        self.in_micro_batches = True
        return logs

    def close(self) -> None:
        """Give the module its ``self.log`` back and remove the loss hooks."""
        self.in_micro_batches = False
        for hook in (self._loss_hook, self._token_loss_hook):
            if hook is not None:
                hook.remove()
        self._loss_hook = self._token_loss_hook = None
        module = self._strategy.lightning_module
        if module is not None and "log" in module.__dict__:
            del module.__dict__["log"]

    def log_step(
        self,
        rank_batch: RankBatch,
        stats: PlanStats | None,
        share: Tensor,
        stage: str,
        user_names: tuple[str, ...] = (),
        *,
        dataset_name: str | None = None,
    ) -> None:
        """Log the exact loss of the global batch and, in training, the plan statistics.

        ``share`` is this rank's sum of micro-batch losses, i.e. its token-loss sum over
        ``T / W``; its mean over the ``W`` ranks is the global token mean. Logged with
        ``batch_size = T``, Lightning's epoch-level weighted mean over batches and ranks is the
        token mean over the whole epoch. A name the module logged itself in this step
        (``user_names``) is left to the module's value.

        A batch of a named validation or test set (``dataset_name``) logs ``val_loss/<name>``
        (``test_loss/<name>``) without Lightning's ``/dataloader_idx_N``; an unnamed one logs
        ``val_loss``, to which Lightning adds ``/dataloader_idx_N`` under several loaders.
        """
        strategy = self._strategy
        if not strategy.skrull_config.log_stats:
            return
        module = strategy.lightning_module
        if module is None or module._trainer is None or module._trainer.barebones:
            return
        on_step = stage == "train"
        key = LOSS_KEYS[stage] if dataset_name is None else f"{LOSS_KEYS[stage]}/{dataset_name}"
        if key in user_names:
            return
        module.log(
            key,
            share.float(),
            on_step=on_step,
            on_epoch=not on_step,
            prog_bar=True,
            # one process: its share is the loss; a step value needs no collective, an epoch
            # value is marked synced all the same (Lightning warns about unsynced epoch values
            # whenever a process group exists, and syncs once at the epoch's end)
            sync_dist=strategy.world_size > 1 or not on_step,
            add_dataloader_idx=dataset_name is None,
            batch_size=max(rank_batch.num_supervised_tokens, 1),
        )
        if stage != "train" or stats is None:
            return
        self._step_tokens = stats.num_tokens
        values = {
            "skrull/supervised_tokens": float(stats.num_supervised_tokens),
            "skrull/tokens": float(stats.num_tokens),
            "skrull/distributed_share": stats.distributed_share,
            "skrull/plan_imbalance": stats.imbalance,
            "skrull/est_step_s": stats.estimated_seconds,
            "skrull/micro_batches_max": float(stats.max_micro_batches),
            "skrull/micro_batches_min": float(stats.min_micro_batches),
            "skrull/micro_batches_rank": float(rank_batch.num_planned_micro_batches),
        }
        self.log_values(values)

    def log_values(self, values: dict[str, float]) -> None:
        """Log per-step values (plan statistics, calibration) unless ``log_stats`` is off.

        Only on the steps whose on-step values Lightning writes to its loggers (every
        ``log_every_n_steps``, and under ``fast_dev_run``), the rule Lightning's own
        ``LearningRateMonitor`` follows: the loggers see the same values as when logging every
        step, and the other steps skip about 0.5 ms of ``self.log`` per value, which a step of
        a few short sequences notices (docs/benchmarks.md, per-sequence overhead).
        """
        if not values or not self.logs_stats_this_step():
            return
        module = self._strategy.lightning_module
        assert module is not None
        for key, value in values.items():
            module.log(key, value, on_step=True, on_epoch=False, batch_size=1)

    def logs_stats_this_step(self) -> bool:
        """Whether :meth:`log_values` logs in this training step (see there)."""
        module = self._strategy.lightning_module
        if not self._strategy.skrull_config.log_stats or module is None:
            return False
        trainer = module._trainer
        if trainer is None or trainer.barebones:
            return False
        fast_dev_run = getattr(trainer, "fast_dev_run", False)  # set by the Trainer's debug flags
        return bool(fast_dev_run) or trainer._logger_connector.should_update_logs

    def log_throughput(self) -> None:
        """Log ``tokens_per_s`` of the step since :meth:`start_step` (once per step)."""
        if self._step_start is None or not self._strategy.skrull_config.log_stats:
            return
        module = self._strategy.lightning_module
        elapsed = time.perf_counter() - self._step_start
        self._step_start = None
        if module is None or module._trainer is None or elapsed <= 0 or not self._step_tokens:
            return
        module.log(
            "tokens_per_s",
            self._step_tokens / elapsed,
            on_step=True,
            on_epoch=False,
            prog_bar=True,
            batch_size=1,
        )
