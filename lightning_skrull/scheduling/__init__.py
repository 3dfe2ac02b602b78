"""Pure planning of Skrull's data scheduling (no torch, no torch.distributed).

``plan_global_batch`` turns the sequence lengths of one global batch into a
:class:`GlobalBatchPlan`: micro-batches per DP rank (GDS) and, inside each, which sequences are
kept whole on one CP rank and which are sharded over the CP group (DACP). ``simulate`` and
``lower_bound`` judge a plan with a :class:`CostModel`; :class:`OnlineCalibrator` refits the
model's constants to measured micro-batch times.
"""

from lightning_skrull.scheduling.calibration import CostModelSchedule, OnlineCalibrator
from lightning_skrull.scheduling.cost_model import CostModel
from lightning_skrull.scheduling.fit import FitSample, fit_cost_model
from lightning_skrull.scheduling.options import PlannerOptions
from lightning_skrull.scheduling.plan import (
    DISTRIBUTED,
    POLICIES,
    CpBlock,
    GlobalBatchPlan,
    MicroBatchPlan,
    Policy,
    degree_shares,
    shard_tokens,
)
from lightning_skrull.scheduling.planner import DEFAULT_COST_MODEL, plan_global_batch
from lightning_skrull.scheduling.shapes import ModelShape
from lightning_skrull.scheduling.simulate import dp_rank_seconds, lower_bound, simulate
from lightning_skrull.scheduling.topology import spans_nodes

__all__ = [
    "DEFAULT_COST_MODEL",
    "DISTRIBUTED",
    "POLICIES",
    "CostModel",
    "CostModelSchedule",
    "CpBlock",
    "FitSample",
    "GlobalBatchPlan",
    "MicroBatchPlan",
    "ModelShape",
    "OnlineCalibrator",
    "PlannerOptions",
    "Policy",
    "degree_shares",
    "dp_rank_seconds",
    "fit_cost_model",
    "lower_bound",
    "plan_global_batch",
    "shard_tokens",
    "simulate",
    "spans_nodes",
]
