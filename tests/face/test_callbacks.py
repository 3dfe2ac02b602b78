"""PlanPictureCallback writes the plan pictures of the first steps, on rank 0 only."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import skrull_planner

import lightning_skrull.viz as viz
from lightning_skrull.callbacks import DEFAULT_SUBDIR, PlanPictureCallback
from lightning_skrull.data.batch import SkrullBatch
from lightning_skrull.data.sources import load_sft_data
from lightning_skrull.scheduling import CostModel

LENGTHS = [5, 40, 3, 17, 60, 8, 2, 25]  # dataset order
BATCHES = [[6, 1, 4, 0], [3, 7, 2, 5]]  # dataset indices of two global batches


def _dataset() -> Any:
    return load_sft_data([{"input_ids": [1] * n} for n in LENGTHS])


def _batch(dataset: Any, indices: list[int], index: int) -> SkrullBatch:
    planner = skrull_planner(bucket_size=32, cost_model=COST_MODEL)
    return planner([dataset[i] for i in indices], indices, 0, index)


COST_MODEL = CostModel()


def _trainer(tmp_path: Path, dataset: Any, *, rank_zero: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        strategy=SimpleNamespace(cost_model=COST_MODEL),
        is_global_zero=rank_zero,
        global_step=0,
        log_dir=str(tmp_path / "version_0"),
        default_root_dir=str(tmp_path),
        datamodule=SimpleNamespace(train_dataset=dataset),
    )


def _record_plot_plan(monkeypatch) -> list[tuple[Any, list[int], dict[str, Any]]]:
    drawn: list[tuple[Any, list[int], dict[str, Any]]] = []
    real = viz.plot_plan

    def recording(plan: Any, lengths: list[int], **kwargs: Any) -> Any:
        drawn.append((plan, list(lengths), kwargs))
        return real(plan, lengths, **kwargs)

    monkeypatch.setattr(viz, "plot_plan", recording)
    return drawn


def test_saves_first_steps_with_the_batch_lengths(tmp_path: Path, monkeypatch) -> None:
    drawn = _record_plot_plan(monkeypatch)
    dataset = _dataset()
    trainer = _trainer(tmp_path, dataset)
    callback = PlanPictureCallback(num_steps=1)
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step, indices in enumerate(BATCHES):
        trainer.global_step = step
        callback.on_train_batch_start(trainer, None, _batch(dataset, indices, step), step)  # type: ignore[arg-type]

    # Only the first step is drawn, into <log_dir>/plans, with the lengths of its samples in
    # global-batch order (the plan's sequence ids index that order).
    expected = tmp_path / "version_0" / DEFAULT_SUBDIR / "step_000000.png"
    assert callback.saved == [expected]
    assert sorted(p.name for p in expected.parent.iterdir()) == ["step_000000.png"]
    assert expected.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(drawn) == 1
    plan, lengths, kwargs = drawn[0]
    assert lengths == [LENGTHS[i] for i in BATCHES[0]]
    assert sorted(plan.all_sequence_ids()) == list(range(len(BATCHES[0])))
    assert kwargs["cost_model"] is None  # no time labels unless asked for


def test_estimates_use_the_strategy_cost_model(tmp_path: Path, monkeypatch) -> None:
    drawn = _record_plot_plan(monkeypatch)
    dataset = _dataset()
    trainer = _trainer(tmp_path, dataset)
    callback = PlanPictureCallback(num_steps=2, estimates=True)
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    for step, indices in enumerate(BATCHES):
        trainer.global_step = step
        callback.on_train_batch_start(trainer, None, _batch(dataset, indices, step), step)  # type: ignore[arg-type]
    assert [p.name for p in callback.saved] == ["step_000000.png", "step_000001.png"]
    assert [kwargs["cost_model"] for _, _, kwargs in drawn] == [COST_MODEL, COST_MODEL]
    assert [lengths for _, lengths, _ in drawn] == [[LENGTHS[i] for i in b] for b in BATCHES]


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    dataset = _dataset()
    trainer = _trainer(tmp_path, dataset, rank_zero=False)
    callback = PlanPictureCallback(num_steps=5, dirpath=tmp_path / "pics")
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    callback.on_train_batch_start(trainer, None, _batch(dataset, BATCHES[0], 0), 0)  # type: ignore[arg-type]
    assert callback.saved == []
    assert not (tmp_path / "pics").exists()


def test_errors_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="num_steps=-1"):
        PlanPictureCallback(num_steps=-1)
    with pytest.raises(ValueError, match="dpi=0"):
        PlanPictureCallback(dpi=0)
    callback = PlanPictureCallback()
    with pytest.raises(RuntimeError, match="once training has started"):
        _ = callback.directory
    trainer = _trainer(tmp_path, _dataset())
    callback.on_train_start(trainer, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="SkrullDataModule"):
        callback.on_train_batch_start(trainer, None, {"input_ids": [1, 2]}, 0)  # type: ignore[arg-type]
