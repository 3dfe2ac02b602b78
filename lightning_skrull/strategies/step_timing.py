"""Online calibration on the strategy's side: time micro-batches, share, refit, hand to the loader.

:class:`StepCalibration` is what a Skrull strategy runs with ``calibration="online"``:

1. **Timing.** Every rank times each micro-batch it runs, from the start of its forward to the
   end of its backward's last gradient accumulation (a post-accumulate-grad hook on every
   parameter). DDP's gradient all-reduce is waited for after that point (its final callback),
   so waiting for other DP ranks is not counted as work. On CUDA the marks are CUDA events
   (no host sync in the step); on CPU ``time.perf_counter``.
2. **Sharing.** Every few steps, after the optimizer step (never inside the micro-batch loop),
   the ranks all-gather one float64 tensor of their timings. Every rank then knows every
   planned micro-batch's time (the slowest CP rank of each) and refits the same
   :class:`~lightning_skrull.scheduling.OnlineCalibrator` on the same rows, so all adopt the
   same model; the per-step plan-hash check proves it.
3. **Hand-over.** An adopted model takes effect :data:`EFFECT_LAG` global batches after the one
   just trained (the loader has already handed out the next one), through the loader's
   :class:`~lightning_skrull.scheduling.CostModelSchedule`. Batches that DataLoader workers
   planned ahead with an older model are planned again in the main process.
4. **Checkpoints.** The schedule (with the current model) is saved in checkpoints and restored
   on resume.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from lightning_skrull.data.batch import SkrullBatch
from lightning_skrull.runtime.process_groups import ParallelLayout
from lightning_skrull.scheduling import (
    CostModel,
    CostModelSchedule,
    GlobalBatchPlan,
    OnlineCalibrator,
)

EFFECT_LAG = 2
"""Global batches between the one whose step adopted a model and the first planned with it
(Lightning has already fetched the next batch when the optimizer step ends)."""

FIRST_INTERVAL = 3
"""Steps between refits at the start, and again after each refit that changed the model."""

MAX_INTERVAL = 48
"""Longest interval: after each refit that keeps the model the interval doubles up to this."""

CHECKPOINT_KEY = "skrull_calibration"
"""Key of the calibration state in a checkpoint."""


class MicroBatchTimer:
    """Marks of the micro-batches this rank runs in a step (CUDA events or perf_counter).

    Args:
        device: the rank's device.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._starts: list[Any] = []
        self._ends: list[Any] = []
        self._active = False

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def begin_step(self) -> None:
        """Forget the marks of the previous step."""
        self._starts, self._ends = [], []
        self._active = False

    def start(self) -> None:
        """A micro-batch's forward starts now."""
        self._starts.append(self._now())
        self._ends.append(None)
        self._active = True

    def mark(self) -> None:
        """Gradient accumulation just ran: the running micro-batch's backward reached here."""
        if self._active:
            self._ends[-1] = self._now()

    def stop(self) -> None:
        """The running micro-batch is over (its end is the last mark, or now)."""
        if self._active and self._ends[-1] is None:
            self._ends[-1] = self._now()
        self._active = False

    def seconds(self) -> list[float]:
        """Seconds of each micro-batch of the step (NaN where no end was marked)."""
        self.stop()
        out = []
        for start, end in zip(self._starts, self._ends, strict=True):
            if end is None:
                out.append(math.nan)
            elif self.cuda:
                end.synchronize()
                out.append(start.elapsed_time(end) / 1e3)
            else:
                out.append(end - start)
        return out


@dataclass
class _Timed:
    plan: GlobalBatchPlan
    lengths: tuple[int, ...]
    seconds: list[float]
    epoch: int
    index: int


@dataclass
class StepCalibration:
    """The online calibration of one rank (see the module docstring).

    Args:
        cost_model: the starting model.
        layout: this rank's place in the DP x CP world.
        device: the rank's device (timing tensors and the all-gather live there).
    """

    cost_model: CostModel
    layout: ParallelLayout
    device: torch.device
    schedule: CostModelSchedule = field(init=False)
    calibrator: OnlineCalibrator = field(init=False)
    timer: MicroBatchTimer = field(init=False)
    interval: int = FIRST_INTERVAL
    _pending: list[_Timed] = field(default_factory=list)
    _current: SkrullBatch | None = None
    _hooks: list[RemovableHandle] = field(default_factory=list)
    _metrics: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.schedule = CostModelSchedule(self.cost_model)
        self.calibrator = OnlineCalibrator(self.cost_model)
        self.timer = MicroBatchTimer(self.device)

    # ------------------------------------------------------------------ model
    @property
    def latest(self) -> CostModel:
        """The most recently adopted model (what the planner will use from its effect on)."""
        return self.schedule.latest

    def attach(self, module: torch.nn.Module) -> None:
        """Mark the end of each backward's gradient accumulation through ``module``'s params."""
        self.detach()
        for p in module.parameters():
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def detach(self) -> None:
        """Remove the gradient hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def _on_grad(self, _: torch.Tensor) -> None:
        self.timer.mark()

    # ------------------------------------------------------------------ step
    def begin_step(self, batch: Any) -> None:
        """A training step starts on ``batch`` (timed only when it is a :class:`SkrullBatch`).

        Raises:
            RuntimeError: the batch was planned with another model than the one the schedule
                gives its position (a loader that planned further ahead than the lag allows).
        """
        self.timer.begin_step()
        self._current = batch if isinstance(batch, SkrullBatch) and batch.lengths else None
        if self._current is None or self._current.planned_with is None:
            return
        expected = self.schedule.model_for(batch.epoch, batch.index)
        if batch.planned_with != expected:
            raise RuntimeError(
                f"global batch {batch.index} of epoch {batch.epoch} was planned with another cost "
                "model than the calibrated one in effect for it; the loader must plan through "
                "the strategy's cost_model_schedule (SkrullDataModule does). Use "
                "calibration='off' with a custom loader."
            )

    def end_step(self) -> None:
        """After the optimizer step: keep this step's timings; every few steps, share and refit."""
        batch, self._current = self._current, None
        if batch is None:
            return
        planned = batch.rank_batch.num_planned_micro_batches
        seconds = self.timer.seconds()[:planned]
        plan = batch.rank_batch.plan
        self._pending.append(_Timed(plan, batch.lengths, seconds, batch.epoch, batch.index))
        if len(self._pending) < self.interval:
            return
        self._share_and_refit()

    def _share_and_refit(self) -> None:
        steps, self._pending = self._pending, []
        widths = [max(len(mbs) for mbs in s.plan.micro_batches) for s in steps]
        local = torch.full((sum(widths),), math.nan, dtype=torch.float64)
        offset = 0
        for s, width in zip(steps, widths, strict=True):
            local[offset : offset + len(s.seconds)] = torch.tensor(s.seconds, dtype=torch.float64)
            offset += width
        gathered = self._all_gather(local)
        cp = self.layout.cp_size
        offset = 0
        for s, width in zip(steps, widths, strict=True):
            per_dp = []
            for d, mbs in enumerate(s.plan.micro_batches):
                rows = gathered[d * cp : (d + 1) * cp, offset : offset + len(mbs)]
                # NaN where a CP rank did not measure: the slowest of the measured ones
                per_dp.append(torch.nan_to_num(rows, nan=-math.inf).max(dim=0).values.tolist())
            per_dp = [[v if v > 0 else math.nan for v in row] for row in per_dp]
            self.calibrator.observe(s.plan, s.lengths, per_dp)
            offset += width
        before = self.calibrator.adopted
        model = self.calibrator.refit()
        last = steps[-1]
        if self.calibrator.adopted > before:
            self.schedule.adopt(model, last.epoch, last.index + EFFECT_LAG)
            self.interval = FIRST_INTERVAL
        else:
            self.interval = min(2 * self.interval, MAX_INTERVAL)
        self._metrics = self.metrics()

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """``[world, n]`` of every rank's timings (this rank's alone without a process group)."""
        layout = self.layout
        if layout.world_size == 1 or not dist.is_initialized():
            return local[None, :]
        tensor = local.to(self.device)
        out = torch.empty(
            layout.world_size * tensor.numel(), dtype=tensor.dtype, device=self.device
        )
        dist.all_gather_into_tensor(out, tensor, group=layout.world_group)
        return out.view(layout.world_size, -1).cpu()

    def take_metrics(self) -> dict[str, float]:
        """The metrics of the last refit, once (empty when no refit ran since the last call)."""
        out, self._metrics = self._metrics, {}
        return out

    def metrics(self) -> dict[str, float]:
        """The current model's constants and prediction error, in readable units."""
        m = self.latest
        out = {
            "skrull/calibration/achieved_tflops": m.achieved_flops / 1e12,
            "skrull/calibration/micro_batch_overhead_ms": m.micro_batch_overhead_s * 1e3,
            "skrull/calibration/per_sequence_ms": m.per_sequence_seconds * 1e3,
            "skrull/calibration/comm_latency_us": m.comm_latency_s * 1e6,
            "skrull/calibration/comm_bandwidth_gbps": m.comm_bandwidth / 1e9,
            "skrull/calibration/refits": float(self.calibrator.refits),
        }
        error = self.calibrator.prediction_error
        if error is not None:
            out["skrull/calibration/prediction_error"] = error
        return out

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Plain data: the schedule's entries (positions and constants)."""
        return {"schedule": self.schedule.state_dict(), "interval": self.interval}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved schedule; the calibrator restarts from its latest model."""
        self.schedule.load_state_dict(state["schedule"])
        self.interval = int(state.get("interval", FIRST_INTERVAL))
        self.calibrator = OnlineCalibrator(self.schedule.latest)
        self._pending = []


class OnlineCalibration:
    """A strategy's online calibration over its fits: a :class:`StepCalibration` started at
    each fit's setup, its state written into checkpoints and applied from a resumed one.

    Args:
        enabled: ``calibration="online"`` (otherwise nothing starts and nothing is saved).
    """

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.running: StepCalibration | None = None
        """The calibration of the current (or last) fit; ``None`` before one started."""
        self._restored: dict[str, Any] | None = None

    def start(
        self,
        cost_model: CostModel,
        layout: ParallelLayout,
        device: torch.device,
        module: torch.nn.Module,
    ) -> None:
        """Start timing this fit's steps from ``cost_model`` (last in setup, after the model and
        the bucket are final); apply a state restored from a checkpoint."""
        self.running = StepCalibration(cost_model, layout, device)
        self.running.attach(module)
        if self._restored is not None:
            self.running.load_state_dict(self._restored)

    def save(self, checkpoint: dict[str, Any]) -> None:
        """Write the running calibration's state into ``checkpoint``."""
        if self.running is not None:
            checkpoint[CHECKPOINT_KEY] = self.running.state_dict()

    def load(self, checkpoint: dict[str, Any]) -> None:
        """Keep a checkpoint's calibration state, applied at setup (or now, when running)."""
        state = checkpoint.get(CHECKPOINT_KEY)
        if state is not None and self.enabled:
            self._restored = state
            if self.running is not None:
                self.running.load_state_dict(state)

    def stop(self) -> None:
        """Remove the running calibration's hooks (teardown); its models stay readable."""
        if self.running is not None:
            self.running.detach()
