"""How :class:`StepLogs` combines a name logged in every micro-batch of a step (docs/lightning.md,
"How a name logged from every micro-batch is combined"), branch by branch.

The reference is the arithmetic written out by hand on the values logged: the token-weighted mean
over micro-batches with supervised tokens, the sum, the largest and smallest value, and for
``sync_dist=True`` the mean over ranks that Lightning then takes, computed here from two ranks'
logs of one global batch. Values are float64 sums of a few numbers: compared to 1e-12.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torchmetrics.classification import MulticlassAccuracy

from lightning_skrull.strategies.step_logging import StepLogs

# Two DP ranks of one global batch (CP=1 for simplicity: W = 2 ranks). Rank 0 runs 3
# micro-batches, rank 1 runs 1 (different counts, as Skrull plans them); rank 0's middle
# micro-batch has no supervised token.
TOKENS = {0: [4, 0, 2], 1: [10]}
VALUES = {0: [0.5, 9.0, 0.25], 1: [0.75]}
T = sum(sum(w) for w in TOKENS.values())  # 16 supervised tokens in the global batch
W = len(TOKENS)


def _logs(rank: int, calls: list[dict[str, Any]]) -> dict[str, tuple[float, dict[str, Any]]]:
    """Runs ``calls`` (``self.log`` keyword arguments, the value taken from :data:`VALUES` unless
    given) in each of ``rank``'s micro-batches; returns what :meth:`StepLogs.flush` logs."""
    logged: dict[str, tuple[float, dict[str, Any]]] = {}

    def log(name: str, value: Any, **kwargs: Any) -> None:
        logged[name] = (value, kwargs)

    logs = StepLogs(log, world_size=W, global_tokens=T)
    assert len(TOKENS[0]) != len(TOKENS[1])
    for i, tokens in enumerate(TOKENS[rank]):
        logs.start_micro_batch(torch.tensor(tokens))
        for call in calls:
            kwargs = dict(call)
            value = kwargs.pop("value", VALUES[rank][i])
            logs.record(value=value, **kwargs)
    logs.flush()
    return logged


def _value(logged: dict[str, tuple[float, dict[str, Any]]], name: str) -> float:
    return float(logged[name][0])


def test_mean_is_token_weighted_per_rank_and_over_the_global_batch_with_sync_dist() -> None:
    calls = [{"name": "acc"}, {"name": "acc_synced", "sync_dist": True}]
    per_rank = {rank: _logs(rank, calls) for rank in TOKENS}
    for rank, logged in per_rank.items():
        # the token-weighted mean of this rank's micro-batches; the one without tokens (9.0)
        # does not count
        weighted = [w * v for w, v in zip(TOKENS[rank], VALUES[rank], strict=True)]
        assert _value(logged, "acc") == pytest.approx(sum(weighted) / sum(TOKENS[rank]), abs=1e-12)
        assert logged["acc"][1]["batch_size"] == T
    # with sync_dist, Lightning's unweighted mean over the ranks is the global token mean
    global_mean = sum(w * v for r in TOKENS for w, v in zip(TOKENS[r], VALUES[r], strict=True)) / T
    synced = sum(_value(per_rank[r], "acc_synced") for r in TOKENS) / W
    assert synced == pytest.approx(global_mean, abs=1e-12)
    # ... which the per-rank means averaged unweighted are not (rank 1 holds 10 of the 16 tokens)
    unweighted = sum(_value(per_rank[r], "acc") for r in TOKENS) / W
    assert abs(unweighted - global_mean) > 1e-2


def test_sum_max_and_min() -> None:
    calls = [
        {"name": "count", "reduce_fx": "sum", "sync_dist": True},
        {"name": "worst", "reduce_fx": "max", "sync_dist": True},
        {"name": "best", "reduce_fx": torch.min},
    ]
    logged = _logs(0, calls)
    assert _value(logged, "count") == pytest.approx(sum(VALUES[0]), abs=1e-12)
    assert _value(logged, "worst") == max(VALUES[0])  # micro-batches without tokens count here
    assert _value(logged, "best") == min(VALUES[0])
    assert {kwargs["batch_size"] for _, kwargs in logged.values()} == {T}


def test_user_batch_size_weights_the_micro_batches_and_ranks_average_unweighted() -> None:
    sizes = [3, 1, 2]  # sequences per micro-batch, as a user passes batch_size

    def with_sizes(rank: int) -> dict[str, tuple[float, dict[str, Any]]]:
        logged: dict[str, tuple[float, dict[str, Any]]] = {}
        logs = StepLogs(lambda n, v, **k: logged.update({n: (v, k)}), world_size=W, global_tokens=T)
        for i, tokens in enumerate(TOKENS[rank]):
            logs.start_micro_batch(torch.tensor(tokens))
            logs.record("per_seq", VALUES[rank][i], sync_dist=True, batch_size=sizes[i])
        logs.flush()
        return logged

    logged = with_sizes(0)
    expected = sum(s * v for s, v in zip(sizes, VALUES[0], strict=True)) / sum(sizes)
    assert _value(logged, "per_seq") == pytest.approx(expected, abs=1e-12)
    assert logged["per_seq"][1]["batch_size"] == sum(sizes)


@pytest.mark.parametrize("option", [{"sync_dist_group": object()}, {"rank_zero_only": True}])
def test_a_group_or_rank_zero_only_logs_the_rank_mean(option: dict[str, Any]) -> None:
    logged = _logs(0, [{"name": "acc", "sync_dist": True, **option}])
    weighted = [w * v for w, v in zip(TOKENS[0], VALUES[0], strict=True)]
    assert _value(logged, "acc") == pytest.approx(sum(weighted) / sum(TOKENS[0]), abs=1e-12)
    for key, value in option.items():
        assert logged["acc"][1][key] is value


def test_a_rank_without_supervised_tokens_logs_the_plain_mean_and_adds_nothing_synced() -> None:
    logged: dict[str, tuple[float, dict[str, Any]]] = {}
    logs = StepLogs(lambda n, v, **k: logged.update({n: (v, k)}), world_size=W, global_tokens=T)
    for value in (1.0, 3.0):
        logs.start_micro_batch(torch.tensor(0))
        logs.record("acc", value)
        logs.record("acc_synced", value, sync_dist=True)
    logs.flush()
    assert _value(logged, "acc") == 2.0
    assert _value(logged, "acc_synced") == 0.0  # its share of the global token mean


def test_model_losses_are_summed_and_metrics_logged_once() -> None:
    logged: dict[str, tuple[Any, dict[str, Any]]] = {}
    logs = StepLogs(lambda n, v, **k: logged.update({n: (v, k)}), world_size=W, global_tokens=T)
    metric = MulticlassAccuracy(num_classes=3, average="micro")
    shares = [torch.tensor(0.2, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)]
    for share in shares:
        logs.start_micro_batch(torch.tensor(2))
        logs.add_model_loss(share)
        logs.record("train_loss", share.detach(), sync_dist=True)
        metric.update(torch.tensor([0, 1]), torch.tensor([0, 2]))
        logs.record("acc", metric)
    logs.flush()
    assert float(logged["train_loss"][0]) == pytest.approx(0.5, abs=1e-12)
    assert logged["acc"][0] is metric
    assert float(metric.compute()) == pytest.approx(0.5)  # both micro-batches accumulated


def test_bad_calls_name_the_value_and_the_fix() -> None:
    logs = StepLogs(lambda *a, **k: None, world_size=W, global_tokens=T)
    with pytest.raises(RuntimeError, match="before start_micro_batch"):
        logs.record("x", 1.0)
    logs.start_micro_batch(torch.tensor(1))
    with pytest.raises(TypeError, match=r"multiple values for \['value'\]"):
        logs.record("x", 1.0, value=2.0)
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['batch'\]"):
        logs.record("x", 1.0, batch=2)
    logs.record("vector", torch.ones(2))
    logs.record("median", 1.0, reduce_fx="median")
    with pytest.raises(ValueError, match=r"'vector'.*shape \(2,\).*reduce it"):
        logs.flush()
    logs = StepLogs(lambda *a, **k: None, world_size=W, global_tokens=T)
    logs.start_micro_batch(torch.tensor(1))
    logs.record("median", 1.0, reduce_fx="median")
    with pytest.raises(ValueError, match=r"reduce_fx='median'.*use 'mean', 'sum', 'max' or 'min'"):
        logs.flush()
    logs = StepLogs(lambda *a, **k: None, world_size=W, global_tokens=T)
    logs.start_micro_batch(torch.tensor(1))
    logs.record("mixed", MulticlassAccuracy(num_classes=3))
    logs.start_micro_batch(torch.tensor(1))
    logs.record("mixed", 1.0)
    with pytest.raises(TypeError, match=r"'mixed'.*Metric in some micro-batches and a value"):
        logs.flush()
