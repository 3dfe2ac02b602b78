"""What a rank's loader yields per optimizer step, and how a rank builds it.

:class:`RankPlanner` plans one global batch and collates this rank's part
(:func:`~lightning_skrull.data.plan_batch.plan_rank_batch`) into a :class:`SkrullBatch` (the
rank's :class:`~lightning_skrull.data.collate.RankBatch` plus the plan's :class:`PlanStats`).
The numbers it needs from the training strategy (DP and CP sizes and ranks, the cost model, the
config) are described by :class:`SkrullTrainingStrategy`, so the data side depends on that
protocol, not on a strategy class.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol, TypeGuard

import torch

from lightning_skrull.config import SkrullConfig
from lightning_skrull.data.collate import RankBatch
from lightning_skrull.data.plan_batch import BatchPlanning, plan_rank_batch
from lightning_skrull.scheduling import (
    DISTRIBUTED,
    CostModel,
    CostModelSchedule,
    GlobalBatchPlan,
    Policy,
    dp_rank_seconds,
)


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """What a Skrull strategy's setup resolved for the data module: the config with its
    bucket known (``bucket_size="auto"`` measured) and what the data is checked against in the
    model the strategy trains. Published as :attr:`SkrullTrainingStrategy.plan_settings`."""

    config: SkrullConfig
    """The strategy's config, its ``bucket_size`` a number of tokens or ``None`` (never
    ``"auto"``): :meth:`SkrullConfig.resolve_bucket_size` gives the bucket to plan with."""
    vocab_size: int | None
    """The trained model's vocabulary size (token ids and labels must be below it)."""
    image_token_id: int | None
    """The image placeholder of a vision-language model trained on text (no input id may be
    it); ``None`` for a text model."""


class SkrullTrainingStrategy(Protocol):
    """What the data module reads from the training strategy (every Skrull strategy has it).

    The rank properties are known once the Trainer set up the process group, the cost model
    once the strategy found the model, the plan settings once its setup resolved them: the
    data module reads them from its loader hooks and when a loader's iteration starts.
    """

    @property
    def plan_settings(self) -> PlanSettings | None:
        """The resolved settings the data is planned with; ``None`` until the strategy found
        the model and knows the bucket (a ``bucket_size="auto"`` is measured late in setup)."""
        ...

    @property
    def cost_model_schedule(self) -> CostModelSchedule | None:
        """Which cost model plans which training batch (``None`` without online calibration)."""
        ...

    @property
    def skrull_config(self) -> SkrullConfig:
        """The strategy's config (bucket size, policy, model attribute)."""
        ...

    @property
    def cp_size(self) -> int:
        """Ranks in one CP group."""
        ...

    @property
    def dp_size(self) -> int:
        """Number of DP ranks."""
        ...

    @property
    def dp_rank(self) -> int:
        """This process's DP rank."""
        ...

    @property
    def cp_rank(self) -> int:
        """This process's rank inside its CP group."""
        ...

    @property
    def cost_model(self) -> CostModel:
        """The planner's cost model."""
        ...

    @property
    def requires_equal_micro_batches(self) -> bool:
        """Whether every DP rank must run the same number of micro-batches per step."""
        ...


_STRATEGY_MEMBERS = (
    "plan_settings",
    "cost_model_schedule",
    "skrull_config",
    "cp_size",
    "dp_size",
    "dp_rank",
    "cp_rank",
    "cost_model",
    "requires_equal_micro_batches",
)


def is_skrull_training_strategy(strategy: object) -> TypeGuard[SkrullTrainingStrategy]:
    """Whether ``strategy`` has every member of :class:`SkrullTrainingStrategy`.

    Looked up statically (``inspect.getattr_static``): the rank properties raise before the
    process group exists, so they must not be evaluated to answer.
    """
    missing = object()
    return all(
        inspect.getattr_static(strategy, name, missing) is not missing for name in _STRATEGY_MEMBERS
    )


@dataclass(frozen=True)
class PlanStats:
    """Statistics of one global batch's plan, identical on every rank.

    Attributes:
        num_sequences: sequences in the global batch.
        num_tokens: tokens in the global batch (all ranks).
        num_supervised_tokens: supervised tokens of the global batch (shifted labels != -100).
        distributed_share: share of the sequences sharded over a CP group (0 with cp_size 1).
        estimated_seconds: the cost model's time of the step (slowest DP rank).
        imbalance: slowest DP rank's estimated time over the mean (1.0 = balanced).
        max_micro_batches: most micro-batches of any DP rank.
        min_micro_batches: fewest micro-batches of any DP rank.
    """

    num_sequences: int
    num_tokens: int
    num_supervised_tokens: int
    distributed_share: float
    estimated_seconds: float
    imbalance: float
    max_micro_batches: int
    min_micro_batches: int


def plan_stats(
    plan: GlobalBatchPlan, lengths: Sequence[int], num_supervised: int, cost_model: CostModel
) -> PlanStats:
    """The :class:`PlanStats` of ``plan`` for sequences of ``lengths``."""
    placements = [p for mbs in plan.micro_batches for mb in mbs for p in mb.placement]
    distributed = sum(1 for p in placements if p == DISTRIBUTED)
    seconds = dp_rank_seconds(plan, lengths, cost_model)
    slowest = max(seconds) if seconds else 0.0
    mean = sum(seconds) / len(seconds) if seconds else 0.0
    counts = [len(mbs) for mbs in plan.micro_batches]
    return PlanStats(
        num_sequences=len(lengths),
        num_tokens=int(sum(lengths)),
        num_supervised_tokens=num_supervised,
        distributed_share=distributed / max(len(placements), 1),
        estimated_seconds=slowest,
        imbalance=slowest / mean if mean > 0 else 1.0,
        max_micro_batches=max(counts),
        min_micro_batches=min(counts),
    )


LOSS_KEYS = {"train": "train_loss", "validation": "val_loss", "test": "test_loss"}
"""Names under which the Skrull strategies log the exact loss of each stage; a batch of a
named validation or test set (:attr:`SkrullBatch.dataset_name`) logs ``<key>/<name>``."""


class SkrullBatch:
    """What the Skrull loader yields per optimizer step on one rank.

    A plain class, not a dataclass, on purpose: Lightning's precision plugins walk batches with
    ``apply_to_collection`` (casting floating tensors, refusing frozen dataclasses); this batch
    is moved as a whole by :meth:`to` and its tensors keep their dtypes (``num_items_in_batch``
    stays float32 under half precision).

    Attributes:
        rank_batch: this rank's micro-batches of the global batch.
        stats: the plan's statistics (the same on every rank).
        epoch: the epoch the global batch belongs to.
        index: the global batch's index inside its epoch.
        lengths: the global batch's sequence lengths (what the plan was made from).
        planned_with: the cost model the plan was made with.
        dataset_name: the name of the validation or test set the batch is from
            (``SkrullDataModule(val_data={name: ...})``); ``None`` for training batches and
            for a single, unnamed set.
    """

    __slots__ = (
        "dataset_name",
        "epoch",
        "index",
        "lengths",
        "planned_with",
        "rank_batch",
        "stats",
    )

    def __init__(
        self,
        rank_batch: RankBatch,
        stats: PlanStats,
        epoch: int,
        index: int,
        *,
        lengths: Sequence[int] = (),
        planned_with: CostModel | None = None,
        dataset_name: str | None = None,
    ) -> None:
        self.rank_batch = rank_batch
        self.stats = stats
        self.epoch = epoch
        self.index = index
        self.lengths = tuple(lengths)
        self.planned_with = planned_with
        self.dataset_name = dataset_name

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SkrullBatch:
        """A copy with every tensor on ``device`` (Lightning calls it to move the batch)."""
        moved = self.rank_batch.to(device, non_blocking=non_blocking)
        return SkrullBatch(
            moved,
            self.stats,
            self.epoch,
            self.index,
            lengths=self.lengths,
            planned_with=self.planned_with,
            dataset_name=self.dataset_name,
        )

    # ------------------------------------------------------------------ throughput
    @property
    def sequences_per_device(self) -> float:
        """The global batch's sequences over the ranks (``dp_size * cp_size``).

        For Lightning's ``ThroughputMonitor(batch_size_fn=...)``: it reports one device's
        figures and multiplies them by the world size for the global ones, which are then
        exactly the global batch's, whatever share of it this rank held.
        """
        return self.stats.num_sequences / self.rank_batch.world_size

    @property
    def tokens_per_device(self) -> float:
        """The global batch's tokens over the ranks, for ``ThroughputMonitor(length_fn=...)``
        (see :attr:`sequences_per_device`)."""
        return self.stats.num_tokens / self.rank_batch.world_size

    def flops_per_device(self, *, backward: bool = True) -> float:
        """Model FLOPs of the global batch over the ranks, for ``ThroughputMonitor``'s MFU.

        Each sequence counts its exact causal forward FLOPs
        (:meth:`~lightning_skrull.scheduling.shapes.ModelShape.forward_flops`: every matmul
        of the decoder and the LM head, attention over ``s (s + 1) / 2`` pairs), for the shape
        of the cost model the plan was made with (the model's own config unless a cost model
        was given), times 3 with ``backward`` (forward + backward, the usual MFU convention:
        recomputation under activation checkpointing and communication are not counted).

        Raises:
            ValueError: a batch built without a cost model (by hand, not by the data module).
        """
        if self.planned_with is None or not self.lengths:
            raise ValueError(
                "This SkrullBatch has no cost model or no sequence lengths to count FLOPs from; "
                "batches from SkrullDataModule have both. Build it with lengths=... and "
                "planned_with=CostModel.from_hf_config(model.config)."
            )
        shape = self.planned_with.shape
        forward = sum(shape.forward_flops(length) for length in self.lengths)
        return (3 if backward else 1) * forward / self.rank_batch.world_size

    def __getitem__(self, key: object) -> NoReturn:
        raise TypeError(
            f"SkrullBatch is not indexable (batch[{key!r}]): it holds this rank's micro-batches "
            "of one global batch, and training_step gets each micro-batch's model inputs. For "
            "ThroughputMonitor use batch_size_fn=lambda b: b.sequences_per_device and "
            "length_fn=lambda b: b.tokens_per_device, and batch.flops_per_device() for MFU."
        )

    def __repr__(self) -> str:
        return (
            f"SkrullBatch(epoch={self.epoch}, index={self.index}, "
            f"micro_batches={len(self.rank_batch.micro_batches)}, "
            f"sequences={self.stats.num_sequences}, tokens={self.stats.num_tokens})"
        )


@dataclass(frozen=True, kw_only=True)
class RankPlanner:
    """Everything a rank needs to turn a global batch into its :class:`SkrullBatch`.

    Attributes:
        dp_size: DP ranks.
        cp_size: ranks per CP group.
        dp_rank: this rank's DP rank.
        cp_rank: this rank's CP rank.
        bucket_size: tokens one CP rank may hold in one micro-batch.
        policy: the planner's policy.
        cost_model: the planner's cost model.
        equal_micro_batches: pad every DP rank to the plan's largest micro-batch count
            (needed by ZeRO-2, which reduces gradients in every backward); otherwise pad only
            ranks without any micro-batch to one (DDP needs one backward per rank and step).
    """

    dp_size: int
    cp_size: int
    dp_rank: int
    cp_rank: int
    bucket_size: int
    policy: Policy
    cost_model: CostModel
    equal_micro_batches: bool = False

    @property
    def world_size(self) -> int:
        """Ranks over which gradients are averaged."""
        return self.dp_size * self.cp_size

    @property
    def planning(self) -> BatchPlanning:
        """The settings :func:`~lightning_skrull.data.plan_batch.plan_rank_batch` plans with."""
        return BatchPlanning(
            dp_size=self.dp_size,
            cp_size=self.cp_size,
            dp_rank=self.dp_rank,
            cp_rank=self.cp_rank,
            bucket_size=self.bucket_size,
            policy=self.policy,
            cost_model=self.cost_model,
            padding="equal" if self.equal_micro_batches else "one",
        )

    def __call__(
        self, samples: Sequence[Mapping[str, Any]], indices: Sequence[int], epoch: int, index: int
    ) -> SkrullBatch:
        """Plan the global batch ``samples`` (dataset ``indices``) and collate this rank's part."""
        planned = plan_rank_batch(samples, self.planning, sample_indices=indices)
        rank_batch = planned.rank_batch
        stats = plan_stats(
            planned.plan, planned.lengths, rank_batch.num_supervised_tokens, self.cost_model
        )
        return SkrullBatch(
            rank_batch=rank_batch,
            stats=stats,
            epoch=epoch,
            index=index,
            lengths=planned.lengths,
            planned_with=self.cost_model,
        )

    def with_cost_model(self, cost_model: CostModel) -> RankPlanner:
        """This planner with another cost model (itself when it already has it)."""
        if cost_model == self.cost_model:
            return self
        return dataclasses.replace(self, cost_model=cost_model)

    @classmethod
    def for_strategy(cls, strategy: SkrullTrainingStrategy, *, bucket_size: int) -> RankPlanner:
        """The planner of this rank under ``strategy`` (after the Trainer set it up)."""
        return cls(
            dp_size=strategy.dp_size,
            cp_size=strategy.cp_size,
            dp_rank=strategy.dp_rank,
            cp_rank=strategy.cp_rank,
            bucket_size=bucket_size,
            policy=strategy.skrull_config.policy,
            cost_model=strategy.cost_model,
            equal_micro_batches=strategy.requires_equal_micro_batches,
        )
