"""Custom losses in ``training_step``: the normalisation rule, the logits, and the warning.

A LightningModule that computes its own loss (here: label smoothing 0.1 and per-token weights,
from logits it asks the model for) trains exactly as one process does when it normalises with
``token_mean_loss``; the same loss as a mean over each micro-batch's tokens trains on another
objective, measurably, and draws the :class:`CustomLossWarning`; the model's own loss draws none.

One spawn of 4 gloo processes, DP=2 x CP=2, runs every multi-process case (2 SGD steps each, DP
ranks running different micro-batch counts, asserted). The reference is independent of the
package: a plain Hugging Face model with eager attention, one sequence at a time, the same
smoothed and weighted token losses summed over the global batch and divided by its supervised
tokens, then ``torch.optim.SGD``.
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    LR,
    PARAM_ATOL,
    PlainLM,
    StartRecorder,
    cpu_trainer,
    float64_params,
    make_data,
    max_diff,
    reference_model,
    reference_training,
)

from lightning_skrull import (
    CustomLossWarning,
    SkrullDataModule,
    SkrullStrategy,
    shifted_labels,
    token_mean_loss,
)
from lightning_skrull.models.chunked_loss import MISSING_LOGITS_NOTE
from lightning_skrull.runtime.launch import spawn

STEPS = 2
NUM_SAMPLES = GLOBAL_BATCH * STEPS
SMOOTHING = 0.1
# float32: the packed, sharded run sums the same token terms in another order than the
# one-sequence-at-a-time reference, and DDP averages over 4 ranks: PARAM_ATOL (2e-6) after 2 SGD
# steps of lr 0.5 (measured 7.5e-9). The logged train_loss: 1e-5 (measured 4.8e-7).
# The per-micro-batch mean moves the update by 2.15x the norm of the reference's update (each rank
# sums about 3 micro-batch means, and every micro-batch weighs alike); TRAP_DISTANCE is far below.
TRAP_DISTANCE = 0.1
# 16-bit: the rule of tests/strategies/test_precision_matrix.py. The relative distance of the bf16-mixed
# update to the float32 reference's update is at most RATIO x the distance of the single-process
# bf16-autocast reference, plus FLOOR (summation order alone moves bf16 updates by ~4e-3 there).
# Measured: the cell 3.8e-3, the reference 4.6e-3 (bound 1.0e-2).
RATIO = 2.0
FLOOR = 1e-3


def token_weights(targets: torch.Tensor) -> torch.Tensor:
    """A per-token weight that depends on the target only: 2 for odd token ids, else 1."""
    return 1.0 + (targets % 2).float()


def smoothed_token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Weighted, label-smoothed cross-entropy of every token, 0 where the target is -100."""
    losses = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="none",
        label_smoothing=SMOOTHING,
    )
    return token_weights(targets.reshape(-1)) * losses


class CustomLM(PlainLM):
    """Label smoothing and per-token weights over the model's logits.

    ``reduction="rule"`` returns ``token_mean_loss``; ``"mean"`` the mean over the micro-batch's
    supervised tokens (the trap: each micro-batch weighs alike whatever its token count; the
    count is clamped so that a micro-batch without supervised tokens gives 0, not NaN).
    """

    def __init__(self, reduction: str = "rule") -> None:
        super().__init__()
        self.reduction = reduction

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # without labels the model returns the logits (with them, the chunked loss returns none)
        logits = self.model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        targets = shifted_labels(batch)
        token_losses = smoothed_token_losses(logits, targets)
        if self.reduction == "rule":
            return token_mean_loss(token_losses, batch)
        supervised = (targets != -100).sum()
        return token_losses.sum() / supervised.clamp_min(1)


class ScaledLossLM(PlainLM):
    """The model's loss, passed through an identity (``* 1.0``): trivially the same value."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss * 1.0


class LogitsOfLabelledCallLM(PlainLM):
    """Reads ``.logits`` of a call with labels: ``None`` under the chunked loss."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(**batch).logits
        return token_mean_loss(smoothed_token_losses(logits, shifted_labels(batch)), batch)


def _fit(module: PlainLM, *, cp_size: int = 2, **kwargs: Any) -> dict[str, Any]:
    """Train ``module`` for :data:`STEPS` steps; its parameters, steps and custom-loss warnings."""
    recorder = StartRecorder()
    trainer = cpu_trainer(
        # one CP rank holds as many tokens as a CP group of 2 (the longest sample, 69 tokens)
        SkrullStrategy(cp_size=cp_size, bucket_size=2 * BUCKET // cp_size),
        max_steps=STEPS,
        callbacks=[recorder],
        **kwargs,
    )
    data = SkrullDataModule(
        train_data=make_data(NUM_SAMPLES), global_batch_size=GLOBAL_BATCH, shuffle=False
    )
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, data)
    return {
        "seconds": time.perf_counter() - start,
        "before": recorder.before,
        "after": float64_params(module.model),
        "steps": recorder.steps,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CustomLossWarning)],
        "train_loss": float(trainer.callback_metrics["train_loss"]),
    }


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    return {
        "rule": _fit(CustomLM("rule")),
        "mean": _fit(CustomLM("mean")),
        "rule_bf16": _fit(CustomLM("rule"), precision="bf16-mixed"),
    }


# ----------------------------------------------------------------------------- reference
@functools.cache
def reference(autocast: bool = False) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    """``(parameters before, after, loss of the last step)`` of plain HF training on the weighted,
    label-smoothed global token mean; ``autocast``: the forward under bf16 autocast (as
    ``bf16-mixed``), float32 parameters, gradients and SGD."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each spawned rank runs; a busy machine's thread waits cost more
    try:
        return _reference(autocast)
    finally:
        torch.set_num_threads(threads)


def _reference(autocast: bool) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], float]:
    data = make_data(NUM_SAMPLES)
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    before, loss = float64_params(model), torch.zeros(())
    for step in range(STEPS):
        total, tokens = torch.zeros(()), 0
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            for sample in data[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]:
                ids = torch.tensor(sample["input_ids"])[None]
                targets = torch.tensor(sample["labels"][1:])
                logits = model(input_ids=ids).logits[0, :-1]
                total = total + smoothed_token_losses(logits, targets).sum()
                tokens += int((targets != -100).sum())
        loss = total / tokens
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return before, float64_params(model), float(loss.detach())


def update(before: dict[str, np.ndarray], after: dict[str, np.ndarray]) -> np.ndarray:
    """Parameters after minus before, all parameters in one flat vector."""
    return np.concatenate([(after[k] - before[k]).ravel() for k in sorted(after)])


def relative_distance(delta: np.ndarray, delta_fp32: np.ndarray) -> float:
    return float(np.linalg.norm(delta - delta_fp32) / np.linalg.norm(delta_fp32))


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_cases, 4, timeout=600)


# ----------------------------------------------------------------------------- 4 ranks
@pytest.mark.multiprocess
def test_dp_ranks_run_different_micro_batch_counts(runs: list[dict[str, Any]]) -> None:
    for case in ("rule", "mean", "rule_bf16"):
        steps = [out[case]["steps"] for out in runs]
        counts = [{s[i]["dp_rank"]: s[i]["run"] for s in steps} for i in range(STEPS)]
        assert any(len(set(c.values())) > 1 for c in counts), counts


@pytest.mark.multiprocess
def test_custom_loss_by_the_rule_equals_single_process(runs: list[dict[str, Any]]) -> None:
    before, after, last_loss = reference()
    # the custom loss matters: plain cross-entropy training moves the parameters elsewhere
    plain, _ = reference_training(STEPS)
    plain64 = {k: plain[k].astype(np.float64) for k in after}
    assert relative_distance(update(before, plain64), update(before, after)) > TRAP_DISTANCE
    for out in runs:
        assert max_diff(out["rule"]["before"], before) == 0.0
        # float32 summation order only (PARAM_ATOL, tests/helpers.py)
        assert max_diff(out["rule"]["after"], after) < PARAM_ATOL
        # the logged train_loss is the sum of token_mean_loss's shares: the global mean
        assert out["rule"]["train_loss"] == pytest.approx(last_loss, abs=1e-5)
        assert out["rule"]["warnings"] == []


@pytest.mark.multiprocess
def test_a_per_micro_batch_mean_trains_on_another_objective_and_warns(
    runs: list[dict[str, Any]],
) -> None:
    before, after, _ = reference()
    delta = update(before, after)
    for rank, out in enumerate(runs):
        moved = relative_distance(update(out["mean"]["before"], out["mean"]["after"]), delta)
        assert moved > TRAP_DISTANCE, moved
        # once per fit, on rank zero only
        assert len(out["mean"]["warnings"]) == (1 if rank == 0 else 0)
    assert "num_items_in_batch" in runs[0]["mean"]["warnings"][0]


@pytest.mark.multiprocess
def test_custom_loss_by_the_rule_in_bf16_mixed(runs: list[dict[str, Any]]) -> None:
    before, after, _ = reference()
    delta_fp32 = update(before, after)
    ref_before, ref_after, _ = reference(autocast=True)
    ref_distance = relative_distance(update(ref_before, ref_after), delta_fp32)
    for out in runs:
        cell = out["rule_bf16"]
        assert max_diff(cell["before"], before) == 0.0
        cell_distance = relative_distance(update(cell["before"], cell["after"]), delta_fp32)
        assert 0.0 < cell_distance <= RATIO * ref_distance + FLOOR, (cell_distance, ref_distance)
        assert cell["warnings"] == []


# ----------------------------------------------------------------------------- the function
def _skrull_batch() -> dict[str, torch.Tensor]:
    """A micro-batch as the collate builds it: pre-shifted labels, -100 at sequence ends."""
    shift = torch.tensor([[5, 7, -100, -100, 3, -100]])
    return {
        "input_ids": torch.tensor([[1, 5, 7, 9, 4, 3]]),
        "shift_labels": shift,
        "labels": shift,
        "num_items_in_batch": torch.tensor(2.5),
    }


def test_token_mean_loss_divides_the_supervised_sum_by_num_items_in_batch() -> None:
    batch = _skrull_batch()
    losses = torch.tensor([[1.0, 2.0, 100.0, float("nan"), 4.0, float("inf")]])
    # the ignored tokens do not count, whatever their value (nan, inf included)
    expected = (1.0 + 2.0 + 4.0) / 2.5
    assert float(token_mean_loss(losses, batch)) == pytest.approx(expected, rel=1e-7)
    # flat token losses are aligned the same way
    assert float(token_mean_loss(losses.reshape(-1), batch)) == pytest.approx(expected, rel=1e-7)


def test_token_mean_loss_on_a_plain_batch_is_the_token_mean() -> None:
    # an unshifted batch (no shift_labels, no num_items_in_batch): transformers' rule
    ids = torch.tensor([[1, 5, 7, 9]])
    batch = {"input_ids": ids, "labels": torch.tensor([[-100, 5, 7, -100]])}
    assert shifted_labels(batch).tolist() == [[5, 7, -100, -100]]
    losses = torch.tensor([[1.0, 3.0, 50.0, 60.0]])
    assert float(token_mean_loss(losses, batch)) == pytest.approx(2.0)
    none = {"labels": torch.full((1, 3), -100)}
    assert float(token_mean_loss(torch.ones(1, 3), none)) == 0.0


def test_token_mean_loss_equals_transformers_loss_on_a_skrull_batch() -> None:
    from lightning_skrull.models import use_chunked_loss

    model = reference_model()
    batch = _skrull_batch()
    batch["position_ids"] = torch.tensor([[0, 1, 2, 0, 1, 2]])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        expected = model(**batch).loss
        token_losses = F.cross_entropy(
            logits[0].float(), shifted_labels(batch)[0], ignore_index=-100, reduction="none"
        )
        assert float(token_mean_loss(token_losses, batch)) == pytest.approx(float(expected), 1e-6)
    # the chunked loss: logits=None with labels, the logits without them
    use_chunked_loss(model, kernel="chunked")
    assert model(**batch).logits is None
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
    assert logits is not None and logits.shape == (1, 6, 64)


def test_token_mean_loss_refuses_reduced_losses_and_missing_labels() -> None:
    batch = _skrull_batch()
    with pytest.raises(
        ValueError, match=r"token losses of shape \(\) for labels of shape \(1, 6\)"
    ):
        token_mean_loss(torch.tensor(1.0), batch)
    with pytest.raises(KeyError, match=r"no 'shift_labels' or 'labels'.*input_ids"):
        token_mean_loss(torch.ones(3), {"input_ids": torch.ones(1, 3)})


# ----------------------------------------------------------------------------- one process
def _fit_one(module: PlainLM, **kwargs: Any) -> dict[str, Any]:
    return _fit(module, cp_size=1, **kwargs)


@pytest.mark.parametrize(
    "module", [PlainLM, ScaledLossLM, lambda: CustomLM("rule")], ids=["loss", "loss*1", "rule"]
)
def test_losses_known_to_follow_the_rule_draw_no_warning(world_of_one: None, module: Any) -> None:
    out = _fit_one(module())
    assert max(s["run"] for s in out["steps"]) > 1  # several micro-batches per step
    assert out["warnings"] == []


def test_an_unrecognised_loss_warns_once_per_fit(world_of_one: None) -> None:
    out = _fit_one(CustomLM("mean"))
    assert max(s["run"] for s in out["steps"]) > 1
    assert len(out["warnings"]) == 1
    assert "token_mean_loss" in out["warnings"][0] and "docs/loss.md" in out["warnings"][0]


def test_reading_logits_of_a_labelled_call_tells_how_to_get_them(world_of_one: None) -> None:
    with pytest.raises((TypeError, AttributeError), match="NoneType") as caught:
        _fit_one(LogitsOfLabelledCallLM())
    assert MISSING_LOGITS_NOTE in getattr(caught.value, "__notes__", [])
    # with the chunked loss off, the same module gets its logits and trains
    trainer = cpu_trainer(SkrullStrategy(bucket_size=2 * BUCKET, chunked_loss=False), max_steps=1)
    data = SkrullDataModule(train_data=make_data(GLOBAL_BATCH), global_batch_size=GLOBAL_BATCH)
    trainer.fit(LogitsOfLabelledCallLM(), data)
    assert trainer.global_step == 1


def test_token_mean_loss_values_are_summed_in_self_log_like_the_model_loss() -> None:
    from lightning_skrull.models.token_loss import observe_token_mean_losses
    from lightning_skrull.strategies.step_logging import StepLogs

    logged: dict[str, float] = {}
    logs = StepLogs(
        lambda name, value, **_: logged.update({name: float(value)}), world_size=4, global_tokens=10
    )
    batch = _skrull_batch()
    handle = observe_token_mean_losses(logs.add_model_loss)
    try:
        shares = []
        for token_losses in (torch.ones(1, 6), 3 * torch.ones(1, 6)):
            logs.start_micro_batch(torch.tensor(3))
            share = token_mean_loss(token_losses, batch)
            shares.append(float(share))
            logs.record("custom", share.detach(), sync_dist=True)
            logs.record("other", share.detach() * 2, sync_dist=True)
            assert logs.follows_loss_rule(share) and logs.follows_loss_rule(share * 1.0)
            assert not logs.follows_loss_rule(share * 2)
    finally:
        handle.remove()
    logs.flush()
    # a pre-normalised share per micro-batch: summed (Lightning's mean over ranks is the global
    # mean); any other value is token-weighted (W / T * sum w_i v_i with sync_dist)
    assert logged["custom"] == pytest.approx(sum(shares))
    assert logged["other"] == pytest.approx(4 / 10 * sum(3 * 2 * s for s in shares))
    # outside the handle nothing is observed
    logs.start_micro_batch(torch.tensor(3))
    assert not logs.follows_loss_rule(token_mean_loss(torch.ones(1, 6), batch))
