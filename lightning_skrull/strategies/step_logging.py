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
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

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
