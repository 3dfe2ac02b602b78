"""The parity harness of the model-family tests: a reference run, a fit, the checks between them.

A family test proves a tiny model of its family under Skrull equal to plain Hugging Face:

- one process (:func:`check_packed_parity`): packed micro-batches of :data:`PACKED_SAMPLES`
  through the prepared model against each sequence alone through the plain model, loss and
  every gradient to :data:`LOSS_RTOL`, :data:`GRAD_RTOL` and (the small router, expert and sink
  gradients, each held to its own size) :data:`EXPERT_RTOL`;
- 4 gloo processes, DP=2 x CP=2, one spawn: :func:`family_cases` runs in each rank a sequence
  sharded over the CP ranks through the routers (:func:`sharded_routing`) and the family's
  Trainer fits (:func:`fit_family`: the documentation's plain module, :class:`FamilyLM`, over
  ``build(arch)``, :data:`STEPS` SGD steps), each one timed;
- the references (:func:`family_reference`, :func:`policy_reference`,
  :func:`master_reference`): plain HF training of the same global batches on one process, in
  float32, under bf16 autocast, under FSDP2's bf16 policy, or with bf16 parameters and float32
  masters (what bf16-mixed ZeRO-2 does);
- the checks of the spawn's runs against them: :func:`check_float32_training`,
  :func:`check_sharded_routing`, :func:`check_float32_master_bf16` (DDP's autocast and FSDP2's
  float32 master shards), :func:`check_zero2_bf16`, :func:`check_micro_batch_counts`; the 16-bit
  rule is tests/precision_rule.py's.

``build`` is a module-level function ``build(arch) -> nn.Module`` (hashable: the references are
cached per ``(build, arch)``).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as L
import numpy as np
import torch
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    LR,
    BatchRecorder,
    bf16_policy_training,
    cpu_trainer,
    make_data,
    make_samples,
    max_diff,
    reference_loss_and_grads,
    sgd_training,
    skrull_strategy,
    tiny_model,
)
from precision_rule import FLOOR, RATIO, Run, relative_distance, update
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_skrull import SkrullDataModule
from lightning_skrull.data.collate import RankBatch, collate_rank
from lightning_skrull.models import prepare_model
from lightning_skrull.runtime.engine import forward_backward, micro_batch_context
from lightning_skrull.runtime.process_groups import ParallelLayout, build_process_groups
from lightning_skrull.scheduling import DISTRIBUTED, GlobalBatchPlan, MicroBatchPlan

Build = Callable[[str], nn.Module]
"""A family's tiny model of an architecture: ``build(arch)``."""
Routing = dict[str, list[dict[str, torch.Tensor]]]
"""Per router, per forward: its logits ``[T, E]`` and top-k experts ``[T, k]``."""


# ----------------------------------------------------------------------------- one process
def one_rank_plan(*micro_batches: tuple[int, ...], bucket_size: int) -> GlobalBatchPlan:
    """A hand-made plan of one process (DP=1, CP=1): one micro-batch of each tuple of sequence
    ids, every sequence local."""
    return GlobalBatchPlan(
        micro_batches=(tuple(MicroBatchPlan(ids, (0,) * len(ids)) for ids in micro_batches),),
        dp_size=1,
        cp_size=1,
        bucket_size=bucket_size,
        policy="hand",
    )


# CP=1: two packed micro-batches of three sequences each (a fully masked one, a 1-token one).
PACKED_SAMPLES = make_samples([23, 1, 2, 9, 17, 5], seed=1, prompt={0: 3}, fully_masked=(2,))
PACKED_PLAN = one_rank_plan((0, 1, 2), (3, 4, 5), bucket_size=32)
# Float32, the same kernels; packing changes the rows the matmuls see and the order the token
# terms are summed in. Every gradient within GRAD_RTOL of the largest reference gradient (the
# model's scale, as max_grad_diff) and, so that the small router and expert gradients (1e-4 to
# 2e-3, against a scale of 0.3-0.6) are held to their own size, each router and expert tensor
# within EXPERT_RTOL of its own largest reference gradient. Measured over tests/models/test_moe.py's
# 12 cases: 5.3e-7 and 9.2e-7 (every tensor, attention and norms included: 9.3e-7); the loss to
# 9.5e-8 relative.
GRAD_RTOL = 1e-6
EXPERT_RTOL = 2e-6
LOSS_RTOL = 1e-6


def is_routed(name: str) -> bool:
    """A router, expert or shared-expert parameter (Qwen-MoE, Mixtral, DeepSeek, GLM names)."""
    return ".experts." in name or "mlp.gate." in name or "shared_expert" in name


def routers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The top-k routers of the sparse layers, in layer order (``Qwen3MoeTopKRouter``,
    ``DeepseekV3TopkRouter``, ...; each returns ``(logits, weights, experts)``)."""
    return [
        (n, m) for n, m in model.named_modules() if type(m).__name__.lower().endswith("topkrouter")
    ]


@contextmanager
def record_routing(model: nn.Module) -> Iterator[Routing]:
    """Per router, per forward in the block: its logits ``[T, E]`` and top-k experts ``[T, k]``."""
    seen: Routing = {}
    handles = []
    for name, router in routers(model):
        seen[name] = []

        def hook(module: nn.Module, args: Any, out: Any, name: str = name) -> None:
            logits, _, experts = out
            seen[name].append({"logits": logits.detach().float(), "experts": experts.detach()})

        handles.append(router.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedRun:
    """What :func:`check_packed_parity` ran."""

    routing: Routing
    """The routing of the packed forward (:func:`record_routing`)."""
    batch: RankBatch
    """The packed micro-batches."""
    reference_loss: float
    """The plain model's loss of the samples."""


def check_packed_parity(
    ref: nn.Module,
    model: nn.Module,
    samples: list[dict[str, list[int]]] = PACKED_SAMPLES,
    plan: GlobalBatchPlan = PACKED_PLAN,
    own_scale: Callable[[str], bool] = is_routed,
) -> PackedRun:
    """``model`` (``prepare_model`` of a copy of ``ref``) on ``samples`` packed by ``plan``,
    one forward and backward, against ``ref`` on each sequence alone: the loss within
    :data:`LOSS_RTOL`, every gradient within :data:`GRAD_RTOL` of the largest reference
    gradient, and each parameter ``own_scale`` picks within :data:`EXPERT_RTOL` of its own
    largest reference gradient (which must not be zero)."""
    ref_loss, ref_grads = reference_loss_and_grads(ref, samples)
    batch = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1)
    assert len(batch.micro_batches) == len(plan.micro_batches[0])
    with record_routing(model) as routing:
        loss = forward_backward(model, batch, cp_group=None, backend="sdpa")
    assert abs(float(loss) - ref_loss) <= LOSS_RTOL * ref_loss
    scale = max(float(g.abs().max()) for g in ref_grads.values())
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        diff = float((p.grad - ref_grads[name]).abs().max())
        assert diff <= GRAD_RTOL * scale, f"{name} differs by {diff} (scale {scale})"
        if own_scale(name):
            own = float(ref_grads[name].abs().max())
            assert own > 0.0, f"{name} has no reference gradient"
            assert diff <= EXPERT_RTOL * own, f"{name} differs by {diff / own:.2e} of its size"
    return PackedRun(routing=routing, batch=batch, reference_loss=ref_loss)


# ----------------------------------------------------------------------------- 4 ranks
STEPS = 2
NUM_SAMPLES = GLOBAL_BATCH * STEPS
# Float32: the packed, sharded runs sum the same token terms in another order than the
# one-sequence-at-a-time reference and average gradients over 4 ranks: parameters after 2 SGD
# steps of lr 0.5 agree to float32 rounding (measured 9.3e-9 at most, every MoE case; MLA
# 1.2e-7), as the dense models' (tests/helpers.py). The router and expert gradients are small
# (their 2-step updates 2e-5 to 1e-4), so each tensor is also held to UPDATE_RTOL of its own
# reference update (measured 5.9e-5 at most, any MoE tensor; MLA 2.2e-4): a router or expert
# gradient 0.1% off fails. Plus one float32 spacing of the tensor's largest value: the weights
# are stored in float32, so two sums in another order may round the same update to neighbouring
# floats (a norm weight just below 1.0 moved by 1.6e-5 lands 5.96e-8 = one spacing away, 3.6e-3
# of its update, with transformers 5.25's Qwen3-MoE), however small the update.
PARAM_ATOL = 2e-6
UPDATE_RTOL = 1e-3
# A sequence sharded over 2 CP ranks: same experts for every token exactly; router logits and
# final hidden states to float32 rounding (the attention sums the K/V blocks in another order;
# measured 6.0e-8 and 7.2e-7 at most over the MoE architectures, 8.3e-7 over the MLA ones).
ROUTING_ATOL = 1e-5
ROUTING_LENGTHS = [61, 47]  # one per DP rank, each sharded over its 2 CP ranks


def full_params(model: nn.Module) -> dict[str, np.ndarray]:
    """Every parameter as a full float64 array (FSDP's DTensors gathered: a collective)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = full.detach().double().cpu().numpy().copy()
    return out


def full_state(model: nn.Module) -> dict[str, np.ndarray]:
    """Every entry of the model's state dict as a full float64 array (a collective for DTensors:
    every rank calls it in the same order)."""
    out = {}
    for key, value in model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        out[key] = full.detach().double().numpy().copy()
    return out


class FullStartRecorder(BatchRecorder):
    """:class:`~helpers.BatchRecorder` that also keeps the full parameters the run starts from
    (after the strategy and the precision plugin have cast and sharded the model)."""

    def __init__(self) -> None:
        super().__init__()
        self.before: dict[str, np.ndarray] = {}

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.before = full_params(module.model)


class FamilyLM(L.LightningModule):
    """The documentation's plain module over a family's tiny model, ``build()``."""

    def __init__(self, build: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.model = build()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def fit_family(
    build: Callable[[], nn.Module], strategy_name: str, precision: str
) -> dict[str, Any]:
    """One Trainer fit on this process group (DP x CP=2) of :class:`FamilyLM` over ``build()``
    under ``strategy_name`` (:func:`~helpers.skrull_strategy`; FSDP: ``shard="cp"``) in
    ``precision``: :data:`STEPS` steps of :data:`NUM_SAMPLES` samples. Returns the full
    parameters ``"before"`` and ``"after"``, the model's ``"dtype"`` and the ``"steps"``."""
    strategy = skrull_strategy(strategy_name, cp_size=2, bucket_size=BUCKET)
    recorder = FullStartRecorder()
    trainer = cpu_trainer(strategy, max_steps=STEPS, callbacks=[recorder], precision=precision)
    module = FamilyLM(build)
    data = SkrullDataModule(
        train_data=make_data(NUM_SAMPLES), global_batch_size=GLOBAL_BATCH, shuffle=False
    )
    trainer.fit(module, data)
    return fit_record(recorder, module.model)


def fit_record(
    recorder: Any,
    model: nn.Module,
    weights: Callable[[nn.Module], dict[str, np.ndarray]] = full_params,
) -> dict[str, Any]:
    """What a parity fit returns: the parameters ``"before"`` (``recorder.before``) and
    ``"after"`` (``weights(model)``: :func:`full_params`, or :func:`full_state`), the model's
    ``"dtype"``, and the ``"steps"`` the :class:`~helpers.BatchRecorder` saw."""
    return {
        "before": recorder.before,
        "after": weights(model),
        "dtype": str(next(model.parameters()).dtype),
        "steps": recorder.steps,
    }


def sharded_routing(arch: str, layout: ParallelLayout, build: Build) -> dict[str, Any]:
    """This rank's shard of its DP rank's sequence of :data:`ROUTING_LENGTHS` through
    ``prepare_model(build(arch))``: its positions, routing and final hidden states."""
    samples = make_samples(ROUTING_LENGTHS, seed=9)
    plan = GlobalBatchPlan(
        micro_batches=(
            (MicroBatchPlan((0,), (DISTRIBUTED,)),),
            (MicroBatchPlan((1,), (DISTRIBUTED,)),),
        ),
        dp_size=2,
        cp_size=2,
        bucket_size=BUCKET,
        policy="hand",
    )
    batch = collate_rank(
        samples, plan, dp_rank=layout.dp_rank, cp_rank=layout.cp_rank, world_size=4
    )
    (mb,) = batch.micro_batches
    model = prepare_model(build(arch), backend="sdpa")
    with micro_batch_context(mb, layout.cp_group, "sdpa"), torch.no_grad():
        with record_routing(model) as routing:
            hidden = model.model(
                input_ids=mb.inputs["input_ids"], position_ids=mb.inputs["position_ids"]
            ).last_hidden_state
    return {
        "sample": layout.dp_rank,
        "positions": mb.inputs["position_ids"][0].tolist(),
        "experts": [calls[0]["experts"].numpy() for calls in routing.values()],
        "logits": [calls[0]["logits"].numpy() for calls in routing.values()],
        "hidden": hidden[0].double().numpy(),
    }


def timed(out: dict[Any, Any], cases: Iterable[Any], run: Callable[[Any], Any]) -> None:
    """``out[case] = run(case)`` for each case, and its seconds in ``out["seconds"][case]``."""
    seconds = out.setdefault("seconds", {})
    for case in cases:
        started = time.perf_counter()
        out[case] = run(case)
        seconds[case] = time.perf_counter() - started


def family_cases(
    archs: Iterable[str],
    build: Build,
    cases: Iterable[Any],
    fit: Callable[[Any], dict[str, Any]],
) -> dict[Any, Any]:
    """What one rank of a family's spawn returns: one intra-op thread, DP=2 x CP=2 groups,
    ``("routing", arch)`` of each of ``archs`` (:func:`sharded_routing` of ``build``), then
    ``fit(case)`` of each of ``cases``, :func:`timed`."""
    torch.set_num_threads(1)
    layout = build_process_groups(cp_size=2)
    out: dict[Any, Any] = {
        ("routing", arch): sharded_routing(arch, layout, build) for arch in archs
    }
    timed(out, cases, fit)
    return out


def moe_model(arch: str) -> nn.Module:
    """The routing runs' tiny model of ``arch``: ``tiny_model(arch, seed=4)``."""
    return tiny_model(arch, seed=4)


# ----------------------------------------------------------------------------- references
@functools.cache
def family_reference(build: Build, arch: str, autocast: bool) -> Run:
    """``(before, after)`` of plain HF training of ``build(arch)`` (eager attention, one
    process, one sequence at a time, the summed token loss over the global batch's supervised
    tokens, SGD), float32 or with the forward under ``torch.autocast("cpu", bfloat16)``."""
    model = build(arch)
    before = full_params(model)
    sgd_training(model, make_data(NUM_SAMPLES), STEPS, autocast=autocast)
    return before, full_params(model)


@functools.cache
def policy_reference(build: Build, arch: str) -> Run:
    """FSDP2's bf16 policy on one process (:func:`~helpers.bf16_policy_training`) of
    ``build(arch)``."""
    return bf16_policy_training(lambda: build(arch), make_data(NUM_SAMPLES), STEPS)


def _bf16(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each array rounded to bf16 (as float64)."""
    return {k: torch.from_numpy(v).bfloat16().double().numpy() for k, v in params.items()}


@functools.cache
def master_reference(build: Build, arch: str) -> Run:
    """What bf16-mixed ZeRO-2 does (docs/precision.md) to ``build(arch)``, on one process: the
    parameters cast to bf16 (buffers float32), bf16 forward and backward, SGD on a float32
    master copy made from the bf16 parameters, copied back to them. That is FSDP2's policy
    started from the bf16 parameters; ``(before, after)`` are the bf16 parameters, the masters
    rounded."""

    def rounded() -> nn.Module:
        model = build(arch)
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).float()
        return model

    before, after = bf16_policy_training(rounded, make_data(NUM_SAMPLES), STEPS)
    return _bf16(before), _bf16(after)


# ----------------------------------------------------------------------------- checks
def check_sharded_routing(runs: list[dict[Any, Any]], arch: str, model: nn.Module) -> None:
    """Each DP rank's sequence, sharded over its 2 CP ranks (:func:`sharded_routing`), against
    ``model`` (the same weights) on one process: every position once, zigzag chunks, the same
    experts for every token in every sparse layer, router logits and final hidden states to
    :data:`ROUTING_ATOL`."""
    samples = make_samples(ROUTING_LENGTHS, seed=9)
    for sample_index, sample in enumerate(samples):
        shards = [out[("routing", arch)] for out in runs]
        shards = [s for s in shards if s["sample"] == sample_index]
        assert len(shards) == 2 and all(len(s["positions"]) > 0 for s in shards)  # sharded
        positions = np.concatenate([s["positions"] for s in shards])
        order = np.argsort(positions, kind="stable")
        length = len(sample["input_ids"])
        assert positions[order][:length].tolist() == list(range(length))
        assert positions[: len(shards[0]["positions"])].max() >= length // 2  # zigzag chunks
        order = order[:length]  # any padding past the sequence is not compared
        with torch.no_grad(), record_routing(model) as routing:
            hidden = model.model(input_ids=torch.tensor([sample["input_ids"]])).last_hidden_state
        assert routing and all(len(calls) == 1 for calls in routing.values())
        for layer, calls in enumerate(routing.values()):
            experts = np.concatenate([s["experts"][layer] for s in shards])[order]
            logits = np.concatenate([s["logits"][layer] for s in shards])[order]
            assert (experts == calls[0]["experts"].numpy()).all()
            assert np.abs(logits - calls[0]["logits"].numpy()).max() < ROUTING_ATOL
        got = np.concatenate([s["hidden"] for s in shards])[order]
        assert np.abs(got - hidden[0].double().numpy()).max() < ROUTING_ATOL


def check_float32_training(
    runs: list[dict[Any, Any]],
    case: Any,
    before: dict[str, np.ndarray],
    after: dict[str, np.ndarray],
) -> None:
    """Every rank's run of ``case`` started from the reference's float32 parameters and ended
    within :data:`PARAM_ATOL` of them, every tensor within :data:`UPDATE_RTOL` of its own
    reference update, and every tensor trained."""
    for out in runs:
        cell = out[case]
        assert cell["dtype"] == "torch.float32"
        assert max_diff(cell["before"], before) == 0.0
        assert max_diff(cell["after"], after) < PARAM_ATOL
        for name in after:
            moved = np.abs(after[name] - before[name]).max()
            diff = np.abs(cell["after"][name] - after[name]).max()
            assert moved > 0.0, f"{name} did not train"
            ulp = float(np.spacing(np.float32(np.abs(after[name]).max())))
            bound = UPDATE_RTOL * moved + ulp
            assert diff <= bound, f"{name}: {diff} of an update of {moved} (bound {bound})"


def check_float32_master_bf16(
    runs: list[dict[Any, Any]],
    case: Any,
    fp32: Run,
    reference: Run,
    error: float = 0.05,
    draws: tuple[Run, ...] = (),
) -> None:
    """docs/precision.md's rule for the bf16-mixed run ``case`` whose parameters stay float32
    (DDP's autocast, FSDP2's master shards): its update against ``fp32``'s, within RATIO x
    ``reference``'s distance (single-process autocast, or FSDP2's policy on one process) plus
    FLOOR; the update made ``error`` too large outside the bound. With ``draws`` (other
    single-process bf16 runs), the reference distance is the largest of theirs and
    ``reference``'s: tests/models/test_mla_moe.py's sigmoid-routed families, whose distance is
    set by the few tokens whose experts bf16 flips (docs/precision.md)."""
    fp32_before, fp32_after = fp32
    delta_fp32 = update(fp32_before, fp32_after)
    ref_distance = max(relative_distance(update(*run), delta_fp32) for run in (reference, *draws))
    assert ref_distance > FLOOR  # the reference's bf16 rounding shows: the bound is not vacuous
    bound = RATIO * ref_distance + FLOOR
    for out in runs:
        cell = out[case]
        assert cell["dtype"] == "torch.float32"  # DDP's parameters, FSDP2's master shards
        assert max_diff(cell["before"], fp32_before) == 0.0
        delta = update(cell["before"], cell["after"])
        distance = relative_distance(delta, delta_fp32)
        assert distance <= bound, (distance, ref_distance)
        assert relative_distance((1 + error) * delta, delta_fp32) > bound


def check_zero2_bf16(
    runs: list[dict[Any, Any]],
    case: Any,
    fp32: Run,
    reference: Run,
    autocast_reference: Run,
    error: float = 0.05,
) -> None:
    """docs/precision.md's rule for the bf16-mixed ZeRO-2 run ``case``: its bf16 parameters'
    update against ``fp32``'s, within RATIO x ``reference``'s distance (bf16 parameters, float32
    masters on one process, :func:`master_reference`) plus FLOOR; the update made ``error``
    too large outside the bound; the run nearer its reference's update than single-process
    autocast's (``autocast_reference``), whose rule it does not follow."""
    delta_fp32 = update(*fp32)
    ref_before, ref_after = reference
    autocast = update(*autocast_reference)
    ref_distance = relative_distance(update(ref_before, ref_after), delta_fp32)
    assert ref_distance > FLOOR
    bound = RATIO * ref_distance + FLOOR
    for out in runs:
        cell = out[case]
        assert cell["dtype"] == "torch.bfloat16"  # the model's copies; the masters are float32
        assert max_diff(cell["before"], ref_before) == 0.0  # the float32 init rounded to bf16
        delta = update(cell["before"], cell["after"])
        distance = relative_distance(delta, delta_fp32)
        assert distance <= bound, (distance, ref_distance)
        assert relative_distance((1 + error) * delta, delta_fp32) > bound
        assert relative_distance(delta, update(ref_before, ref_after)) < relative_distance(
            delta, autocast
        )


def check_micro_batch_counts(runs: list[dict[Any, Any]], case: Any) -> None:
    """Every rank ran :data:`STEPS` steps of ``case``, and in some step the DP ranks planned
    different micro-batch counts."""
    steps = [out[case]["steps"] for out in runs]
    assert all(len(s) == STEPS for s in steps)
    planned = [{s[i]["dp_rank"]: s[i]["planned"] for s in steps} for i in range(STEPS)]
    assert any(len(set(counts.values())) > 1 for counts in planned)
