"""Lightning callbacks that show what the Skrull planner did.

:class:`PlanPictureCallback` saves a picture of the plan of each of the first training steps
(drawn by :func:`lightning_skrull.viz.plot_plan`) next to the logs, so the placement of every
sequence (local on one CP rank, or sharded over the CP group) and the micro-batches of every
DP rank can be looked at after a run. Needs matplotlib (``pip install lightning-skrull[viz]``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from typing_extensions import override

from lightning_skrull import viz
from lightning_skrull.data.batch import SkrullBatch

if TYPE_CHECKING:
    from lightning_skrull.scheduling.cost_model import CostModel

DEFAULT_SUBDIR = "plans"
"""Folder, under the logger's directory, that receives the pictures."""


class PlanPictureCallback(pl.Callback):
    """Save the plan picture of the first ``num_steps`` training steps as PNG files.

    Every rank plans the same global batch, so only global rank 0 draws and writes. The
    picture of a step is written when the step *starts* (``on_train_batch_start``), so the plan
    of a step that fails (out of memory, say) is on disk too. Files are named
    ``step_000000.png``, ``step_000001.png``, ... by the Trainer's ``global_step``.

    Works with the batches of :class:`~lightning_skrull.SkrullDataModule` (their plan, and the
    lengths read from the data module's training dataset).

    Args:
        num_steps: how many steps to draw: the first ``num_steps`` steps of each ``fit`` (of a
            resumed run, the first ones after the resume point).
        dirpath: folder for the pictures; ``None``: ``<trainer.log_dir>/plans`` (the logger's
            version folder, or ``default_root_dir`` without a logger).
        dp_ranks: DP ranks to draw (default all; with many DP ranks the picture gets tall).
        dpi: resolution of the PNG files.
        estimates: label every micro-batch and DP rank with the time the strategy's cost model
            estimates (its hardware constants: an H100 by default, so on other hardware the
            labels rank plans correctly but are not wall time unless the model was fitted).

    Attributes:
        saved: the files this process wrote, in order (empty on every rank but 0).

    Raises:
        ValueError: ``num_steps`` below 0 or ``dpi`` below 1.
    """

    def __init__(
        self,
        num_steps: int = 3,
        *,
        dirpath: str | os.PathLike[str] | None = None,
        dp_ranks: Sequence[int] | None = None,
        dpi: int = 100,
        estimates: bool = False,
    ) -> None:
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 0:
            raise ValueError(f"num_steps={num_steps!r} is invalid; give an int >= 0.")
        if isinstance(dpi, bool) or not isinstance(dpi, int) or dpi < 1:
            raise ValueError(f"dpi={dpi!r} is invalid; give an int >= 1.")
        self.num_steps = num_steps
        self.dirpath = None if dirpath is None else Path(dirpath)
        self.dp_ranks = None if dp_ranks is None else tuple(dp_ranks)
        self.dpi = dpi
        self.estimates = estimates
        self._resolved_dir: Path | None = None
        self._drawn = 0
        self.saved: list[Path] = []

    @property
    def directory(self) -> Path:
        """Where the pictures go.

        Raises:
            RuntimeError: before training started (the logger's folder is not known yet).
        """
        if self._resolved_dir is None:
            raise RuntimeError(
                "PlanPictureCallback.directory is known once training has started; read it "
                "after trainer.fit (or pass dirpath=...)."
            )
        return self._resolved_dir

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._drawn = 0
        if self.dirpath is not None:
            self._resolved_dir = self.dirpath
        else:
            # trainer.log_dir broadcasts from rank 0: every rank must call it, here.
            self._resolved_dir = Path(trainer.log_dir or trainer.default_root_dir) / DEFAULT_SUBDIR

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not trainer.is_global_zero or self._drawn >= self.num_steps:
            return
        cost_model = getattr(trainer.strategy, "cost_model", None) if self.estimates else None
        self.save_picture(batch, _training_lengths(trainer), trainer.global_step, cost_model)
        self._drawn += 1

    def save_picture(
        self,
        batch: SkrullBatch,
        dataset_lengths: Sequence[int],
        step: int,
        cost_model: CostModel | None = None,
    ) -> Path:
        """Draw ``batch``'s plan and write it as ``step_<step>.png``; returns the file.

        Args:
            batch: a batch of the Skrull loader (``SkrullBatch``) of this step.
            dataset_lengths: token count of every sample of the dataset the batch came from.
            step: the optimizer step, for the file name and the title.
            cost_model: label the picture with this model's time estimates (``None``: none).

        Raises:
            TypeError: ``batch`` is not a Skrull batch.
        """
        if not isinstance(batch, SkrullBatch):
            raise TypeError(
                f"PlanPictureCallback needs the batches of SkrullDataModule, got "
                f"{type(batch).__name__}; train with Trainer(strategy='skrull') and a "
                "lightning_skrull.SkrullDataModule."
            )
        rank_batch = batch.rank_batch
        lengths = [dataset_lengths[i] for i in rank_batch.sample_indices]
        plan = rank_batch.plan
        stats = batch.stats
        title = (
            f"step {step}: {plan.policy}, DP={plan.dp_size} x CP={plan.cp_size}, "
            f"bucket {plan.bucket_size}\n{stats.num_sequences} sequences, "
            f"{stats.num_tokens} tokens, {stats.distributed_share:.0%} of them distributed"
        )
        fig = viz.plot_plan(
            plan, lengths, dp_ranks=self.dp_ranks, title=title, cost_model=cost_model
        )
        directory = self.directory
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"step_{step:06d}.png"
        try:
            fig.savefig(path, dpi=self.dpi)
        finally:
            import matplotlib.pyplot as plt

            plt.close(fig)
        self.saved.append(path)
        return path


def _training_lengths(trainer: pl.Trainer) -> Sequence[int]:
    """Lengths of the samples the training loader reads (indexed by dataset index)."""
    datamodule = getattr(trainer, "datamodule", None)
    dataset = getattr(datamodule, "train_dataset", None)
    if dataset is None:
        loader = trainer.train_dataloader
        dataset = getattr(getattr(loader, "dataset", None), "dataset", None)
    lengths = getattr(dataset, "lengths", None)
    if lengths is None:
        raise TypeError(
            "PlanPictureCallback could not find the training samples' lengths; it works with "
            "lightning_skrull.SkrullDataModule (whose train_dataset has .lengths)."
        )
    return lengths  # type: ignore[no-any-return]
