"""Measured training speed of every scheduling policy, end to end, on CPU processes.

Real optimizer steps (forward, backward, AdamW) through ``Trainer(strategy=SkrullStrategy(...))``
on gloo processes started by :func:`lightning_skrull.runtime.launch.spawn`, in two layouts:
CP=2 on 2 processes, and DP=2 x CP=2 on 4 processes. Per layout and dataset, every global batch
is trained once under each policy (``skrull``, ``dacp``, ``static``, ``sorted``,
``round_robin``), one step after the other in one Trainer (the order of the policies rotates
from batch to batch), so a change in machine load hits every policy alike; plain Lightning DDP
(no CP, one sequence per forward, gradient accumulation over the rank's share) trains the same
global batches in a Trainer of its own, alternating with the Skrull one, when every sequence of
the measured batches fits the per-rank token budget.

Each step's plan is made by :class:`lightning_skrull.data.batch.RankPlanner`, the planner
that ``SkrullDataModule`` runs, with that step's policy and the strategy's cost model.

The cost model is fitted to this machine first: a calibration phase trains other global
batches of every dataset under every policy with the default (H100-class) constants, and
:func:`lightning_skrull.scheduling.fit.fit_cost_model` fits the constants to the measured
forward/backward times (the busiest rank's CPU time, see :func:`busiest_cpu`). The measured phase
then plans with the fitted model, and the table shows the fitted model's estimate
(:func:`lightning_skrull.scheduling.simulate` plus the step's fixed part, see :class:`Fitted`)
next to the measured time: a prediction, the measured steps were not used in the fit.

Workload (the paper's settings scaled down, see docs/benchmarks.md):

- model: Qwen2 architecture, random weights, hidden 128, 2 layers, 4 query / 2 KV heads of 32,
  SwiGLU 256, vocabulary 1024, float32. Its attention costs as much as the rest of a layer at
  about 1.1K tokens, as Qwen2.5-0.5B's does at about 17K: lengths are scaled by 1/16.
- data: the shares of the paper's Table 1 (under 1K / 4K / 8K / 32K / 128K tokens, longest)
  with every length divided by 16, log-uniform inside each band, shortest 4 tokens; lengths over
  one CP group's capacity (2 x 4096) are cut to it.
- 64 sequences per DP rank per step for the long-tailed sets (as in the paper), 16 for
  ChatQA2-Long-SFT (its sequences are 20x longer); bucket 4096 tokens per rank.

Run::

    python -m benchmarks.e2e_cpu                    # both layouts, ~10 min on 2 cores
    python -m benchmarks.e2e_cpu --write-docs       # and replace the table in docs/benchmarks.md
    python -m benchmarks.e2e_cpu --layouts cp2 --batches 2 --calibration 1   # a quick look

Absolute numbers depend on the machine and its load: 4 processes on 2 cores share them (each
process gets at most half a core), so the DP=2 x CP=2 wall times are about twice what 4 free
cores would give, and more under other load; the CPU-time columns are robust to that. Compare
policies inside one layout only. Raw results go to ``benchmarks/out/`` (JSON, and a pickle per
layout).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import pickle
import random
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from benchmarks.lengths import DATASETS, Dataset, sample_lengths
from benchmarks.rss import peak_rss_kib
from lightning_skrull.scheduling import POLICIES

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
CHART = ROOT / "docs" / "img" / "e2e_cpu.png"
BEGIN, END = "<!-- e2e_cpu:begin -->", "<!-- e2e_cpu:end -->"
ONLINE_BEGIN, ONLINE_END = "<!-- e2e_calibration:begin -->", "<!-- e2e_calibration:end -->"
CALIBRATED_FROM = 4
"""First global batch of a run that a refitted model can plan: the first refit follows step 3
(batch 2) and takes effect two batches later (strategies/step_timing.py)."""

DDP = "ddp (no CP)"
LENGTH_SCALE = 16
"""Every length of the paper's Table 1 is divided by this."""
BUCKET = 4096
CP_SIZE = 2
SEED = 1234

MODEL: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 2 * BUCKET,
    "tie_word_embeddings": False,
    "use_cache": False,
}
"""The benchmark model (Qwen2 architecture, random weights)."""


PER_DP_RANK = {"Wikipedia": 64, "LMsysChat1M": 64, "ChatQA2-Long-SFT": 16}
"""Sequences per DP rank in one global batch, per dataset. ChatQA2-Long-SFT has 20x more tokens
per sequence than the long-tailed sets: 16 per DP rank keeps a step at seconds on this machine
(64 would make it tens of seconds)."""


@dataclass(frozen=True)
class Layout:
    """A process layout of the benchmark."""

    key: str
    name: str
    dp_size: int
    cp_size: int

    @property
    def world_size(self) -> int:
        return self.dp_size * self.cp_size


LAYOUTS = (
    Layout("cp2", "CP=2 on 2 processes", 1, CP_SIZE),
    Layout("dp2cp2", "DP=2 x CP=2 on 4 processes", 2, CP_SIZE),
)


# --------------------------------------------------------------------------- work items
@dataclass(frozen=True)
class Step:
    """One optimizer step to run: a global batch under one policy."""

    phase: str  # "warmup", "calibration" or "measure"
    dataset: str
    batch: int  # index of the global batch inside its dataset and phase
    policy: str
    indices: tuple[int, ...]  # sample indices into the dataset's pool


@dataclass
class Spec:
    """What the worker processes run (picklable)."""

    layout: Layout
    pools: dict[str, list[list[int]]]  # dataset -> token ids of every sample
    warmup: list[Step]
    calibration: list[Step]
    measure: dict[str, list[list[Step]]]  # dataset -> rounds -> steps
    ddp: dict[str, list[list[tuple[int, ...]]]]  # dataset -> rounds -> global batches
    tile_size: int
    online: dict[str, list[Step]] = field(default_factory=dict)  # dataset -> steps (skrull)


@dataclass
class Record:
    """What one rank measured for one step."""

    step: Step | None
    seconds: float  # barrier to barrier, optimizer step included
    fwd_bwd_seconds: float  # barrier to the optimizer step (gradient all-reduce included)
    cpu_seconds: float  # CPU time this process used in the step (all its threads)
    cpu_fwd_bwd_seconds: float  # the same, up to the optimizer step
    peak_rss_kib: int
    peak_rank_tokens: int  # most tokens this rank fed the model in one micro-batch
    plan: Any = None  # the step's GlobalBatchPlan (rank 0)


@dataclass
class OnlineRun:
    """One Trainer of the calibration comparison: a wrong initial model, ``online`` or ``off``."""

    dataset: str
    start: str  # name of the wrong initial model
    calibration: str
    records: list[Record]
    final: dict[str, float] = field(default_factory=dict)  # constants at the end
    effect: list[int] = field(default_factory=list)  # first batch of each adopted model
    errors: dict[str, float | None] = field(default_factory=dict)  # model -> median rel. error
    rows: int = 0  # micro-batches the errors are measured on


@dataclass
class WorkerResult:
    """Everything one rank returns."""

    rank: int
    records: dict[str, list[Record]] = field(default_factory=dict)  # phase key -> records
    fitted: dict[str, float] = field(default_factory=dict)
    ddp_records: dict[str, list[Record]] = field(default_factory=dict)
    ddp_skipped: dict[str, str] = field(default_factory=dict)
    wall: dict[str, float] = field(default_factory=dict)
    online: list[OnlineRun] = field(default_factory=list)


# --------------------------------------------------------------------------- memory
def _reset_peak_rss() -> None:
    """Reset the kernel's peak-RSS mark of this process (Linux; elsewhere a no-op)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# --------------------------------------------------------------------------- worker parts
class _StepTimer(L.Callback):
    """Times optimizer steps between two barriers; the forward/backward part ends where the
    optimizer step begins. ``every`` batches make one step (plain DDP accumulates).

    Besides wall time it records the process's CPU time of the step (up to the closing
    barrier): on a machine shared with other work, the busiest rank's CPU time is what the step
    would take on dedicated cores, apart from waits for communication."""

    def __init__(self, every: int = 1) -> None:
        self.every = every
        self.records: list[Record] = []
        self._t0 = self._t1 = self._c0 = self._c1 = 0.0
        self._tokens = 0
        self._plan: Any = None

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx % self.every == 0:
            torch.distributed.barrier()
            _reset_peak_rss()
            self._tokens = 0
            self._t0 = time.perf_counter()
            self._c0 = time.process_time()
        rank_batch = getattr(batch, "rank_batch", None)
        if rank_batch is not None:
            self._tokens = max(mb.num_tokens for mb in rank_batch.micro_batches)
            self._plan = rank_batch.plan
        else:
            self._tokens = max(self._tokens, int(batch["input_ids"].shape[1]))

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self._t1 = time.perf_counter()
        self._c1 = time.process_time()

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if (batch_idx + 1) % self.every:
            return
        cpu = time.process_time() - self._c0
        torch.distributed.barrier()
        t = time.perf_counter()
        self.records.append(
            Record(
                step=None,
                seconds=t - self._t0,
                fwd_bwd_seconds=self._t1 - self._t0,
                cpu_seconds=cpu,
                cpu_fwd_bwd_seconds=self._c1 - self._c0,
                peak_rss_kib=peak_rss_kib(),
                peak_rank_tokens=self._tokens,
                plan=self._plan if trainer.is_global_zero else None,
            )
        )


class _SFT(L.LightningModule):
    """The plain module of the docs: the loss is the Hugging Face model's."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2Config, Qwen2ForCausalLM

        torch.manual_seed(0)
        self.model = Qwen2ForCausalLM(Qwen2Config(**MODEL))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class _StepStream(IterableDataset):
    """This rank's SkrullBatch of every step, each planned with the step's policy."""

    def __init__(
        self,
        steps: Sequence[Step],
        pool: dict[str, list[list[int]]],
        planners: Any,
        schedule: Any = None,
    ) -> None:
        super().__init__()
        self.steps = steps
        self.pool = pool
        self.planners = planners
        self.schedule = schedule  # online calibration: the model of each batch position

    def __len__(self) -> int:
        return len(self.steps)

    def __iter__(self) -> Any:
        for k, step in enumerate(self.steps):
            ids = self.pool[step.dataset]
            samples = [{"input_ids": ids[i]} for i in step.indices]
            planner = self.planners[step.policy]
            if self.schedule is not None:
                planner = planner.with_cost_model(self.schedule.model_for(0, k))
            yield planner(samples, list(step.indices), 0, k)


class _InterleavedPolicies(L.LightningDataModule):
    """Global batches under changing policies, planned like ``SkrullDataModule`` plans them."""

    def __init__(self, steps: Sequence[Step], pool: dict[str, list[list[int]]]) -> None:
        super().__init__()
        self.steps = steps
        self.pool = pool

    def train_dataloader(self) -> DataLoader:
        from lightning_skrull.data.batch import RankPlanner

        strategy: Any = self.trainer.strategy
        planners = {
            policy: RankPlanner(
                dp_size=strategy.dp_size,
                cp_size=strategy.cp_size,
                dp_rank=strategy.dp_rank,
                cp_rank=strategy.cp_rank,
                bucket_size=BUCKET,
                policy=policy,
                cost_model=strategy.cost_model,
            )
            for policy in POLICIES
        }
        schedule = strategy.cost_model_schedule  # None unless calibration="online"
        stream = _StepStream(self.steps, self.pool, planners, schedule)
        return DataLoader(stream, batch_size=None, collate_fn=_identity)


def _identity(x: Any) -> Any:
    return x


class _Samples(torch.utils.data.Dataset):
    """One sample per item, as ``[1, S]`` tensors (plain DDP, batch size 1)."""

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.tensor(self.rows[i]).unsqueeze(0)
        return {"input_ids": ids, "labels": ids}


def _collate_one(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    assert len(items) == 1
    return items[0]


def cpu_trainer(strategy: Any, steps: int, callback: L.Callback, **kwargs: Any) -> L.Trainer:
    """A quiet CPU Trainer of ``steps`` steps without validation, over this process group's
    ranks (one process without one), with ``callback``."""
    dist = torch.distributed
    return L.Trainer(
        accelerator="cpu",
        devices=dist.get_world_size() if dist.is_initialized() else 1,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[callback],
        **kwargs,
    )


def _run_skrull(
    spec: Spec, steps: Sequence[Step], cost_model: Any, calibration: str = "off"
) -> tuple[list[Record], Any]:
    """Train ``steps``; the records of every step, and the strategy's online calibration
    (``None`` with ``calibration="off"``, which the policy comparison uses: every policy plans
    with the same fixed model)."""
    from lightning_skrull import SkrullStrategy

    timer = _StepTimer()
    strategy = SkrullStrategy(
        cp_size=spec.layout.cp_size,
        bucket_size=BUCKET,
        attention_backend="sdpa",
        cost_model=cost_model,
        calibration=calibration,
    )
    trainer = cpu_trainer(strategy, len(steps), timer)
    trainer.fit(_SFT(), datamodule=_InterleavedPolicies(steps, spec.pools))
    for record, step in zip(timer.records, steps, strict=True):
        record.step = step
    # the strategy's calibration state (its calibrator holds every timed micro-batch)
    return timer.records, strategy._calibration


def _run_ddp(spec: Spec, dataset: str, batches: list[tuple[int, ...]]) -> list[Record]:
    from lightning.pytorch.strategies import DDPStrategy

    world = torch.distributed.get_world_size()
    per_rank = len(batches[0]) // world
    rows = [spec.pools[dataset][i] for batch in batches for i in batch]
    timer = _StepTimer(every=per_rank)
    trainer = cpu_trainer(DDPStrategy(), len(batches), timer, accumulate_grad_batches=per_rank)
    loader = DataLoader(_Samples(rows), batch_size=1, shuffle=False, collate_fn=_collate_one)
    trainer.fit(_SFT(), train_dataloaders=loader)
    return timer.records


CONSTANTS = ("achieved_flops", "micro_batch_overhead_s", "comm_latency_s", "comm_bandwidth")


@dataclass(frozen=True)
class Fitted:
    """A cost model fitted to measured steps, plus the fixed part of a step.

    The planner's cost model prices micro-batches; it leaves out what every plan of a step pays
    alike (the gradient all-reduce, the plan check, logging). ``step_s`` is that part, taken as
    the intercept that best explains the measured forward/backward times next to the library's
    least-squares fit of the four constants.
    """

    model: Any
    step_s: float

    def estimate(self, plan: Any, lengths: list[int]) -> float:
        """Estimated forward/backward seconds of a step."""
        from lightning_skrull.scheduling import simulate

        return simulate(plan, lengths, self.model) + self.step_s

    def constants(self) -> dict[str, float]:
        """The fitted numbers."""
        return {**{k: getattr(self.model, k) for k in CONSTANTS}, "step_s": self.step_s}


def busiest_cpu(ranks: Sequence[Record]) -> float:
    """CPU seconds of a step's forward and backward on its busiest rank.

    This is what the cost model predicts: the step's time on cores of its own. On a machine
    shared with other work, a process waits for a core as well, and the wall time grows with
    the load of the moment (the table shows both); the CPU time a process uses does not.
    """
    return max(r.cpu_fwd_bwd_seconds for r in ranks)


def fit(
    records: list[Record], seconds: list[float], pools: dict[str, list[list[int]]], model: Any
) -> Fitted:
    """Fit the cost model to measured steps with the library's fitting function.

    ``seconds[k]`` is the measured time of ``records[k]``'s step (its forward/backward part).

    The per-step intercept is searched on a grid (from 0 to 90% of the fastest step); for each
    value the four constants are fitted by :func:`~lightning_skrull.scheduling.fit.fit_cost_model`
    to the times minus the intercept, and the pair with the smallest median relative error wins.
    """
    from lightning_skrull.scheduling import FitSample, simulate
    from lightning_skrull.scheduling.fit import fit_cost_model

    lengths = [[len(pools[r.step.dataset][i]) for i in r.step.indices] for r in records]
    best: tuple[float, Fitted] | None = None
    for c in (0.9 * min(seconds) * i / 30 for i in range(31)):
        samples = [FitSample(r.plan, ls, t - c) for r, ls, t in zip(records, lengths, seconds)]
        fitted = fit_cost_model(model, samples)
        errors = [
            abs(simulate(r.plan, ls, fitted) + c - t) / t
            for r, ls, t in zip(records, lengths, seconds)
        ]
        error = statistics.median(errors)
        if best is None or error < best[0]:
            best = (error, Fitted(fitted, c))
    assert best is not None
    return best[1]


def _worker(rank: int, world_size: int, spec: Spec) -> WorkerResult:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    result = WorkerResult(rank=rank)
    start = time.perf_counter()
    default = default_cost_model(spec.tile_size)
    records, _ = _run_skrull(spec, spec.warmup + spec.calibration, default)
    result.records["calibration"] = records[len(spec.warmup) :]
    result.wall["calibration"] = time.perf_counter() - start
    # The model is fitted to the busiest rank's CPU time (see busiest_cpu): gather every rank's.
    cpu: list[Any] = [None] * world_size
    mine = [r.cpu_fwd_bwd_seconds for r in result.records["calibration"]]
    torch.distributed.all_gather_object(cpu, mine)
    fitted: list[Any] = [None]
    if rank == 0:
        busiest = [max(per_step) for per_step in zip(*cpu)]
        fitted[0] = fit(result.records["calibration"], busiest, spec.pools, default)
    torch.distributed.broadcast_object_list(fitted, src=0)
    model = fitted[0].model
    result.fitted = fitted[0].constants()
    for dataset, rounds in spec.measure.items():
        t = time.perf_counter()
        result.records[dataset] = []
        result.ddp_records[dataset] = []
        ddp_rounds = spec.ddp.get(dataset)
        if ddp_rounds is None:
            result.ddp_skipped[dataset] = "does not fit"
        for r, steps in enumerate(rounds):
            result.records[dataset] += _run_skrull(spec, steps, model)[0][1:]  # first: warm-up
            if ddp_rounds is not None:
                result.ddp_records[dataset] += _run_ddp(spec, dataset, ddp_rounds[r])[1:]
        result.wall[dataset] = time.perf_counter() - t
    t = time.perf_counter()
    for dataset, steps in spec.online.items():
        for k, (name, start) in enumerate(wrong_models(model).items()):
            modes = ("off", "online") if k % 2 == 0 else ("online", "off")
            for mode in modes:  # the order alternates, so a drift in load hits both alike
                result.online.append(_online_run(spec, dataset, steps, name, start, mode))
    result.wall["online"] = time.perf_counter() - t
    return result


def wrong_models(fitted: Any) -> dict[str, Any]:
    """Deliberately wrong starting models, derived from the model fitted to this machine."""
    free = {"comm_latency_s": 0.0, "comm_bandwidth": 1e30}
    return {
        "free communication": fitted.with_constants(**free),
        "free communication, 100x FLOP/s": fitted.with_constants(
            **free, achieved_flops=100 * fitted.achieved_flops
        ),
    }


def _online_run(
    spec: Spec, dataset: str, steps: list[Step], name: str, start: Any, mode: str
) -> OnlineRun:
    """Train ``steps`` from ``start`` with calibration ``mode``; with ``"online"``, the
    calibrated model's prediction error next to the offline fit's on the same micro-batches."""
    from lightning_skrull.scheduling.fit import fit_cost_model

    records, calibration = _run_skrull(spec, steps, start, calibration=mode)
    run = OnlineRun(dataset, name, mode, records)
    if calibration is None:
        run.final = _model_constants(start)
        return run
    calibrator = calibration.calibrator
    final = calibration.latest
    run.final = _model_constants(final)
    run.effect = [e["index"] for e in calibration.schedule.state_dict()[1:]]
    rows = calibrator.observations()
    run.rows = len(rows)
    offline = fit_cost_model(start, rows)
    offline_seq = fit_cost_model(start, rows, fit_per_sequence=True)
    run.errors = {
        "start": calibrator.error_of(start),
        "online": calibrator.error_of(final),
        "offline": calibrator.error_of(offline),
        "offline, per-sequence term": calibrator.error_of(offline_seq),
    }
    return run


def _model_constants(model: Any) -> dict[str, float]:
    return {k: float(getattr(model, k)) for k in (*CONSTANTS, "per_sequence_seconds")}


# --------------------------------------------------------------------------- main process
def global_batch_size(dataset: Dataset, layout: Layout) -> int:
    """Sequences per optimizer step of ``dataset`` in ``layout``."""
    return PER_DP_RANK[dataset.name] * layout.dp_size


def build_spec(
    layout: Layout,
    batches: int,
    calibration: int,
    rounds: int,
    seed: int,
    online_steps: int = 0,
    online_datasets: Sequence[str] = (),
) -> Spec:
    """Samples, and the order of the steps, of one layout (deterministic in ``seed``).

    Global batch ``0`` of each dataset warms up, ``1 .. calibration`` calibrate the cost
    model, the next ``batches`` are measured, in ``rounds`` Skrull/DDP alternations; the next
    ``online_steps`` of each of ``online_datasets`` train from wrong models with online
    calibration and without.
    """
    rng = random.Random(seed)
    capacity = layout.cp_size * BUCKET
    pools: dict[str, list[list[int]]] = {}
    first_online = 1 + calibration + batches
    online_rng = random.Random(f"{seed}-online")  # the other batches stay as without them
    for ds in DATASETS:
        n = first_online * global_batch_size(ds, layout)
        lengths = sample_lengths(ds, n, capacity, rng, scale=LENGTH_SCALE)
        pools[ds.name] = [[rng.randrange(MODEL["vocab_size"]) for _ in range(n)] for n in lengths]
        if ds.name in online_datasets:
            n = online_steps * global_batch_size(ds, layout)
            lengths = sample_lengths(ds, n, capacity, online_rng, scale=LENGTH_SCALE)
            pools[ds.name] += [
                [online_rng.randrange(MODEL["vocab_size"]) for _ in range(n)] for n in lengths
            ]

    def indices(ds: Dataset, k: int) -> tuple[int, ...]:
        g = global_batch_size(ds, layout)
        return tuple(range(k * g, (k + 1) * g))

    def rotated(k: int) -> tuple[str, ...]:
        return POLICIES[k % len(POLICIES) :] + POLICIES[: k % len(POLICIES)]

    warmup = [Step("warmup", ds.name, 0, "static", indices(ds, 0)) for ds in DATASETS]
    calib = [
        Step("calibration", ds.name, 1 + k, p, indices(ds, 1 + k))
        for k in range(calibration)
        for i, ds in enumerate(DATASETS)
        for p in rotated(k + i)
    ]
    measure: dict[str, list[list[Step]]] = {}
    ddp: dict[str, list[list[tuple[int, ...]]]] = {}
    per_round = -(-batches // rounds)
    for ds in DATASETS:
        ks = list(range(1 + calibration, 1 + calibration + batches))
        measure[ds.name] = []
        ddp_rounds = []
        for r in range(rounds):
            mine = ks[r * per_round : (r + 1) * per_round]
            if not mine:
                continue
            # the first step of every Trainer is a warm-up (DDP's first backward builds buckets)
            steps = [Step("warmup", ds.name, 0, "static", indices(ds, 0))]
            steps += [
                Step("measure", ds.name, k, p, indices(ds, k)) for k in mine for p in rotated(k)
            ]
            measure[ds.name].append(steps)
            ddp_rounds.append([indices(ds, 0)] + [indices(ds, k) for k in mine])
        longest = max(len(pools[ds.name][i]) for b in ddp_rounds for batch in b for i in batch)
        if longest <= BUCKET:
            ddp[ds.name] = ddp_rounds
    online = {
        name: [
            Step("online", name, k, "skrull", indices(ds, first_online + k))
            for k in range(online_steps)
        ]
        for ds in DATASETS
        if (name := ds.name) in online_datasets
    }
    return Spec(layout, pools, warmup, calib, measure, ddp, tile_size=1, online=online)


@dataclass
class Row:
    """One line of the table (medians over the measured steps, peaks over steps and ranks)."""

    dataset: str
    policy: str
    steps: int = 0
    step_s: float | None = None
    fwd_bwd_s: float | None = None
    cpu_fwd_bwd_s: float | None = None
    est_s: float | None = None
    refit_s: float | None = None
    tokens_per_s: float | None = None
    speedup: float | None = None
    cpu_s: float | None = None
    cpu_speedup: float | None = None
    peak_tokens: int | None = None
    peak_rss_mib: float | None = None
    plan_ms: float | None = None
    note: str = ""

    @staticmethod
    def error_of(est: float | None, measured: float | None) -> float | None:
        """Relative error of an estimate against a measured time."""
        if est is None or not measured:
            return None
        return (est - measured) / measured

    @property
    def error(self) -> float | None:
        """Error of the calibrated cost model's prediction (against the busiest rank's CPU
        time of forward and backward)."""
        return self.error_of(self.est_s, self.cpu_fwd_bwd_s)

    @property
    def wall_error(self) -> float | None:
        """Error of the same prediction against the wall time of forward and backward."""
        return self.error_of(self.est_s, self.fwd_bwd_s)

    @property
    def refit_error(self) -> float | None:
        """Error of a cost model fitted to the measured steps themselves."""
        return self.error_of(self.refit_s, self.cpu_fwd_bwd_s)


def _plan_ms(policy: str, lengths: list[int], layout: Layout, model: Any) -> float:
    """Fastest of three planning times of one global batch, in ms."""
    from lightning_skrull.scheduling import plan_global_batch

    best = math.inf
    for _ in range(3):
        t = time.perf_counter()
        plan_global_batch(
            lengths,
            dp_size=layout.dp_size,
            cp_size=layout.cp_size,
            bucket_size=BUCKET,
            cost_model=model,
            policy=policy,
        )
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def _cell(
    dataset: str,
    policy: str,
    recs: list[list[Record]],
    lengths: list[list[int]],
    models: tuple[Fitted, Fitted] | None,
) -> Row:
    """The row of one policy: ``recs[k][rank]`` is step ``k`` on ``rank``."""
    row = Row(
        dataset=dataset,
        policy=policy,
        steps=len(recs),
        step_s=statistics.median(rs[0].seconds for rs in recs),
        fwd_bwd_s=statistics.median(rs[0].fwd_bwd_seconds for rs in recs),
        cpu_fwd_bwd_s=statistics.median(busiest_cpu(rs) for rs in recs),
        tokens_per_s=statistics.median(sum(ls) / rs[0].seconds for rs, ls in zip(recs, lengths)),
        cpu_s=statistics.median(max(r.cpu_seconds for r in rs) for rs in recs),
        peak_tokens=max(r.peak_rank_tokens for rs in recs for r in rs),
        peak_rss_mib=max(r.peak_rss_kib for rs in recs for r in rs) / 1024,
    )
    if models is not None:
        calibrated, refit = models
        plans = [rs[0].plan for rs in recs]
        row.est_s = statistics.median(calibrated.estimate(p, ls) for p, ls in zip(plans, lengths))
        row.refit_s = statistics.median(refit.estimate(p, ls) for p, ls in zip(plans, lengths))
    return row


def default_cost_model(tile_size: int) -> Any:
    """The benchmark model's cost model with the library's default (H100-class) constants."""
    from transformers import Qwen2Config

    from lightning_skrull.scheduling import CostModel

    return CostModel.from_hf_config(Qwen2Config(**MODEL), tile_size=tile_size)


def _calibrated(spec: Spec, result: WorkerResult) -> Fitted:
    constants = dict(result.fitted)
    step_s = constants.pop("step_s")
    return Fitted(default_cost_model(spec.tile_size).with_constants(**constants), step_s)


def summarise(spec: Spec, results: list[WorkerResult]) -> tuple[list[Row], Fitted]:
    """Rows of the table for one layout, and the cost model refitted to the measured steps."""
    calibrated = _calibrated(spec, results[0])
    default = default_cost_model(spec.tile_size)
    measured = [r for ds in DATASETS for r in results[0].records[ds.name]]
    busiest = [
        busiest_cpu([res.records[ds.name][k] for res in results])
        for ds in DATASETS
        for k in range(len(results[0].records[ds.name]))
    ]
    refit = fit(measured, busiest, spec.pools, default)
    rows: list[Row] = []
    for ds in DATASETS:
        pool = spec.pools[ds.name]
        cells: dict[str, Row] = {}
        for policy in POLICIES:
            ks = [k for k, r in enumerate(results[0].records[ds.name]) if r.step.policy == policy]
            recs = [[res.records[ds.name][k] for res in results] for k in ks]
            lengths = [[len(pool[i]) for i in rs[0].step.indices] for rs in recs]
            cell = _cell(ds.name, policy, recs, lengths, (calibrated, refit))
            cell.plan_ms = statistics.median(
                _plan_ms(policy, ls, spec.layout, calibrated.model) for ls in lengths
            )
            cells[policy] = cell
        ddp_recs = results[0].ddp_records.get(ds.name) or []
        if ddp_recs:
            batches = [b for rounds in spec.ddp[ds.name] for b in rounds[1:]]
            lengths = [[len(pool[i]) for i in b] for b in batches]
            recs = [[res.ddp_records[ds.name][k] for res in results] for k in range(len(ddp_recs))]
            cells[DDP] = _cell(ds.name, DDP, recs, lengths, None)
        else:
            longest = max(len(s) for s in pool)
            cells[DDP] = Row(ds.name, DDP, note=f"longest {longest} > bucket: does not fit")
        static = cells["static"]
        for row in cells.values():
            if row.step_s and static.step_s:
                row.speedup = static.step_s / row.step_s
            if row.cpu_s and static.cpu_s:
                row.cpu_speedup = static.cpu_s / row.cpu_s
            rows.append(row)
    return rows, refit


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if value is None else format(value, spec) + suffix


def table(rows: list[Row]) -> str:
    """The markdown table of ``rows``."""
    out = [
        "| dataset | policy | step s | tokens/s | vs static | CPU s | vs static (CPU) "
        "| CPU fwd+bwd s | model s | error | peak tokens/rank | peak RSS MiB | plan ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cols = [
            r.dataset,
            r.policy + (f" ({r.note})" if r.note else ""),
            _fmt(r.step_s, ".3f"),
            _fmt(r.tokens_per_s, ",.0f"),
            _fmt(r.speedup, ".2f", "x"),
            _fmt(r.cpu_s, ".3f"),
            _fmt(r.cpu_speedup, ".2f", "x"),
            _fmt(r.cpu_fwd_bwd_s, ".3f"),
            _fmt(r.est_s, ".3f"),
            _fmt(r.error, "+.0%"),
            _fmt(r.peak_tokens, "d"),
            _fmt(r.peak_rss_mib, ",.0f"),
            _fmt(r.plan_ms, ".2f"),
        ]
        out.append("| " + " | ".join(cols) + " |")
    return "\n".join(out) + "\n"


def describe_data(spec: Spec) -> str:
    """One line per dataset: what the measured global batches hold."""
    out = []
    for ds in DATASETS:
        steps = [s for rounds in spec.measure[ds.name] for s in rounds if s.phase == "measure"]
        batches = sorted({s.indices for s in steps})
        pool = spec.pools[ds.name]
        tokens = [sum(len(pool[i]) for i in b) for b in batches]
        lengths = [len(pool[i]) for b in batches for i in b]
        out.append(
            f"- {ds.name}: {len(batches)} measured global batches of {len(batches[0])} sequences, "
            f"{min(tokens)}-{max(tokens)} tokens each; sequence lengths {min(lengths)}-"
            f"{max(lengths)}, median {int(statistics.median(lengths))}, "
            f"{sum(n > BUCKET for n in lengths)} over the bucket"
        )
    return "\n".join(out)


def run_layout(layout: Layout, args: argparse.Namespace) -> tuple[Spec, list[Row], dict]:
    from lightning_skrull.runtime.launch import spawn

    datasets = [d for d in args.online_datasets.split(",") if d]
    spec = build_spec(
        layout, args.batches, args.calibration, args.rounds, args.seed, args.online_steps, datasets
    )
    if args.online_only:
        spec.measure, spec.ddp = {}, {}
    t = time.perf_counter()
    results = spawn(_worker, layout.world_size, spec, timeout=args.timeout)
    wall = time.perf_counter() - t
    raw = args.json.with_name(f"{args.json.stem}_{layout.key}.pkl")
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_bytes(pickle.dumps((spec, results, wall)))  # to re-summarise without re-running
    if args.online_only:
        return spec, [], {"results": results, "online_s": results[0].wall.get("online", 0.0)}
    rows, refit = summarise(spec, results)
    info = {
        "wall_s": wall,
        "phases_s": results[0].wall,
        "fitted": results[0].fitted,
        "refit": refit.constants(),
        "calibration_steps": len(results[0].records["calibration"]),
        "calibration_error": _calibration_error(spec, results),
        "results": results,
        "online_s": results[0].wall.get("online", 0.0),
    }
    return spec, rows, info


def _calibration_error(spec: Spec, results: list[WorkerResult]) -> float:
    """Median relative error of the calibrated model on its own calibration steps."""
    model = _calibrated(spec, results[0])
    errors = []
    for k, r in enumerate(results[0].records["calibration"]):
        lengths = [len(spec.pools[r.step.dataset][i]) for i in r.step.indices]
        measured = busiest_cpu([res.records["calibration"][k] for res in results])
        errors.append(abs(model.estimate(r.plan, lengths) - measured) / measured)
    return statistics.median(errors)


def _constants(c: dict[str, float]) -> str:
    return (
        f"{c['achieved_flops'] / 1e9:.2f} GFLOP/s, micro-batch overhead "
        f"{c['micro_batch_overhead_s'] * 1e3:.1f} ms, collective latency "
        f"{c['comm_latency_s'] * 1e6:.0f} us, bandwidth {c['comm_bandwidth'] / 1e9:.3g} GB/s, "
        f"fixed part of a step {c['step_s'] * 1e3:.0f} ms"
    )


def render(blocks: list[tuple[Spec, list[Row], dict]], args: argparse.Namespace) -> str:
    """The markdown section written into docs/benchmarks.md."""
    cmd = "python -m benchmarks.e2e_cpu" + (" " + " ".join(args.argv) if args.argv else "")
    lines = [
        f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores, 1 thread per process; load average at the start "
        f"{args.load_start:.1f}).",
        "",
    ]
    for spec, rows, info in blocks:
        errors = [abs(r.error) for r in rows if r.error is not None]
        wall = [abs(r.wall_error) for r in rows if r.wall_error is not None]
        refit = [abs(r.refit_error) for r in rows if r.refit_error is not None]
        within = sum(e <= 0.15 for e in errors)
        lines += [
            f"**{spec.layout.name}** ({rows[0].steps} measured steps per policy and dataset; "
            f"{info['wall_s']:.0f} s wall):",
            "",
            describe_data(spec),
            "",
            table(rows),
            f'Cost model ("model s", against "CPU fwd+bwd s") fitted on '
            f"{info['calibration_steps']} calibration steps (median error on them "
            f"{info['calibration_error']:.0%}): {_constants(info['fitted'])}. "
            f"{within} of {len(errors)} policy rows within 15%; median error "
            f"{statistics.median(errors):.0%}, largest {max(errors):.0%} (against the wall "
            f"time of forward and backward: median {statistics.median(wall):.0%}, largest "
            f"{max(wall):.0%}). Refitted to the "
            f"measured steps themselves (in-sample): median error "
            f"{statistics.median(refit):.0%}, largest {max(refit):.0%} "
            f"({_constants(info['refit'])}).",
            "",
        ]
    return "\n".join(lines)


def online_table(spec: Spec, results: list[WorkerResult]) -> str:
    """The calibration comparison of one layout: per dataset and wrong model, ``off`` against
    ``online`` on the same global batches, and the prediction errors on the timed
    micro-batches."""
    runs = results[0].online
    if not runs:
        return ""
    lines = [
        f"| dataset | initial model | calibration | step s (all) | step s (from batch "
        f"{CALIBRATED_FROM}) | tokens/s (from batch {CALIBRATED_FROM}) | vs off | "
        "FLOP/s at the end | latency at the end | models adopted (first batch) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    errors = [
        "| dataset | initial model | micro-batches | initial model's error | online (end) | "
        "offline fit | offline fit + per-sequence term |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for run in runs:
        pool = spec.pools[run.dataset]
        later = run.records[CALIBRATED_FROM:]
        step_all = statistics.median(r.seconds for r in run.records)
        step_late = statistics.median(r.seconds for r in later)
        tokens = statistics.median(
            sum(len(pool[i]) for i in r.step.indices) / r.seconds for r in later
        )
        (off,) = [
            o
            for o in runs
            if (o.dataset, o.start, o.calibration) == (run.dataset, run.start, "off")
        ]
        base = statistics.median(r.seconds for r in off.records[CALIBRATED_FROM:])
        adopted = ", ".join(str(i) for i in run.effect) if run.effect else "none"
        lines.append(
            f"| {run.dataset} | {run.start} | {run.calibration} | {step_all:.3f} | "
            f"{step_late:.3f} | {tokens:,.0f} | {base / step_late:.2f}x | "
            f"{run.final['achieved_flops'] / 1e9:.3g} G | "
            f"{run.final['comm_latency_s'] * 1e6:.0f} us | "
            f"{adopted if run.calibration == 'online' else 'n/a'} |"
        )
        if run.errors:
            e = run.errors
            errors.append(
                f"| {run.dataset} | {run.start} | {run.rows} | {_pct(e['start'])} | "
                f"{_pct(e['online'])} | {_pct(e['offline'])} | "
                f"{_pct(e['offline, per-sequence term'])} |"
            )
    return "\n".join(lines) + "\n\n" + "\n".join(errors) + "\n"


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0%}"


def render_online(blocks: list[tuple[Spec, list[WorkerResult], float]], args: Any) -> str:
    """The calibration section written into docs/benchmarks.md."""
    cmd = "python -m benchmarks.e2e_cpu" + (" " + " ".join(args.argv) if args.argv else "")
    lines = [
        f"Command: `{cmd}` ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
        f"{os.cpu_count()} CPU cores; load average at the start {args.load_start:.1f}).",
        "",
    ]
    for spec, results, wall in blocks:
        steps = {name: len(s) for name, s in spec.online.items()}
        lines += [
            f"**{spec.layout.name}** ({', '.join(f'{n}: {k} steps' for n, k in steps.items())} "
            f"per run; {wall:.0f} s wall for the comparison):",
            "",
            online_table(spec, results),
        ]
    return "\n".join(lines)


def write_docs(section: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the text between the markers of docs/benchmarks.md with ``section``."""
    text = DOC.read_text()
    if begin not in text or end not in text:
        raise SystemExit(f"{DOC} lacks the markers {begin} / {end}; add them where the table goes.")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    DOC.write_text(f"{head}{begin}\n{section}\n{end}{tail}")


def chart(blocks: list[tuple[Spec, list[Row], dict]], path: Path) -> None:
    """Bar chart of every policy's speedup over static (wall and CPU time), per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [*POLICIES, DDP]
    fig, axes = plt.subplots(1, len(blocks), figsize=(6.5 * len(blocks), 4), squeeze=False)
    width = 0.8 / len(policies)
    for ax, (spec, rows, _) in zip(axes[0], blocks):
        names = [ds.name for ds in DATASETS]
        for j, policy in enumerate(policies):
            cells = {r.dataset: r for r in rows if r.policy == policy}
            xs = [i + (j - (len(policies) - 1) / 2) * width for i in range(len(names))]
            wall = [getattr(cells.get(n), "speedup", None) or 0.0 for n in names]
            cpu = [getattr(cells.get(n), "cpu_speedup", None) or 0.0 for n in names]
            bars = ax.bar(xs, wall, width * 0.9, label=policy, color=f"C{j}")
            ax.scatter(xs, cpu, color="black", marker="_", s=120, zorder=3)
            for bar, value in zip(bars, wall):
                if value == 0.0:
                    ax.text(bar.get_x() + bar.get_width() / 2, 0.05, "n/a", rotation=90,
                            ha="center", va="bottom", fontsize=7)  # fmt: skip
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(names)), names)
        ax.set_ylabel("speedup over static (bar: wall, mark: CPU time)")
        ax.set_title(spec.layout.name)
    axes[0][0].legend(fontsize="small", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark and print (and optionally write) the tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="cp2,dp2cp2", help="comma list of cp2, dp2cp2")
    parser.add_argument("--batches", type=int, default=4, help="measured global batches per set")
    parser.add_argument("--calibration", type=int, default=1, help="global batches per set")
    parser.add_argument("--rounds", type=int, default=2, help="Skrull/DDP alternations per set")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds per layout")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "out" / "e2e_cpu.json")
    parser.add_argument(
        "--online-steps", type=int, default=24, help="steps per run of the calibration comparison"
    )
    parser.add_argument(
        "--online-datasets",
        default="Wikipedia,LMsysChat1M",
        help="comma list of datasets of the calibration comparison ('' for none)",
    )
    parser.add_argument(
        "--online-only", action="store_true", help="only the calibration comparison (and its fit)"
    )
    args = parser.parse_args(argv)
    raw = sys.argv[1:] if argv is None else argv
    args.argv = [a for a in raw if a != "--write-docs"]
    args.load_start = os.getloadavg()[0]
    keys = args.layouts.split(",")
    unknown = [k for k in keys if k not in {lay.key for lay in LAYOUTS}]
    if unknown:
        raise SystemExit(f"unknown layouts {unknown}; choose from cp2, dp2cp2")
    blocks = []
    online = []
    t = time.perf_counter()
    for layout in LAYOUTS:
        if layout.key not in keys:
            continue
        print(f"running {layout.name} ...", flush=True)
        spec, rows, info = run_layout(layout, args)
        results = info.pop("results")
        if spec.online:
            online.append((spec, results, info["online_s"]))
            print(render_online(online[-1:], args), flush=True)
        if rows:
            blocks.append((spec, rows, info))
            print(render([(spec, rows, info)], args), flush=True)
    print(f"total {time.perf_counter() - t:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps(
            [
                {"layout": spec.layout.name, "info": info, "rows": [asdict(r) for r in rows]}
                for spec, rows, info in blocks
            ],
            indent=1,
        )
    )
    if args.write_docs:
        if blocks:
            write_docs(render(blocks, args))
            chart(blocks, CHART)
            print(f"wrote {DOC} and {CHART}")
        if online:
            write_docs(render_online(online, args), ONLINE_BEGIN, ONLINE_END)
            print(f"wrote the calibration section of {DOC}")


if __name__ == "__main__":
    main()
