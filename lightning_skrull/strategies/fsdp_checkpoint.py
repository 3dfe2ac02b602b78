"""The checkpoint folders of :class:`~lightning_skrull.strategies.fsdp.SkrullFSDPStrategy`
(``torch.distributed.checkpoint``, ``save_distributed_checkpoint=True``): the refusal to resume a
fit from one without optimizer states, and their consolidation into one Lightning file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.utilities.load import _METADATA_FILENAME
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict


def refuse_weights_only_resume(folder: Path) -> None:
    """Refuse to restore optimizer states from ``folder`` when it is a checkpoint folder that
    holds the weights only (``ModelCheckpoint(save_weights_only=True)``); anything else passes.

    Lightning's ``ModelParallelStrategy`` asks ``torch.distributed.checkpoint`` for the
    optimizer states too, which fails on such a folder with "Missing key in checkpoint
    state_dict: optimizer_0.param_groups.0.lr"; this names the cause and the fix instead.

    Raises:
        KeyError: the folder holds no optimizer state.
    """
    if not (folder.is_dir() and (folder / ".metadata").is_file()):
        return
    keys = FileSystemReader(folder).read_metadata().state_dict_metadata
    if not any(key.startswith("optimizer_") for key in keys):
        raise KeyError(
            f"Trying to restore optimizer state but the checkpoint {str(folder)!r} "
            "contains only the model, probably because ModelCheckpoint(save_weights_only"
            "=True) wrote it. Resume from a checkpoint written without it, or start a "
            "new fit from its weights: SkrullFSDPStrategy.consolidate_checkpoint(folder, "
            "file) writes them as one file, which LightningModule.load_from_checkpoint "
            "loads."
        )


def consolidate_checkpoint(folder: str | Path, file: str | Path) -> None:
    """Write the checkpoint folder ``folder`` (``save_distributed_checkpoint=True``) as one
    Lightning checkpoint file ``file``, on one process without a process group.

    The file holds the full weights under ``state_dict`` (the LightningModule's keys) and
    Lightning's loop, callback and loader state from the folder's ``meta.pt``, so a plain
    ``LightningModule.load_from_checkpoint(file)`` loads it, on one process with no Skrull
    strategy. The optimizer states stay under ``optimizer_0``, ... as
    ``torch.distributed.checkpoint`` keyed them (by parameter name): to continue the run
    with its optimizer, resume from the folder.
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` alone leaves ``meta.pt``
    out (``load_from_checkpoint`` then fails on ``'pytorch-lightning_version'``),
    and Lightning's ``python -m lightning.pytorch.utilities.consolidate_checkpoint`` expects
    the weights under ``model``, as its ``FSDPStrategy`` writes them. Everything is read
    into host memory: the whole model and its optimizer states.
    """
    folder, file = Path(folder), Path(file)
    meta = folder / _METADATA_FILENAME
    if not meta.is_file():
        raise ValueError(
            f"{folder} is not a SkrullFSDPStrategy checkpoint folder: it has no "
            f"{_METADATA_FILENAME} (Lightning's loop state). Give the folder that "
            "trainer.save_checkpoint or ModelCheckpoint wrote with "
            "save_distributed_checkpoint=True."
        )
    checkpoint: dict[str, Any] = {}
    _load_state_dict(
        checkpoint,
        storage_reader=FileSystemReader(folder),
        planner=_EmptyStateDictLoadPlanner(),
        no_dist=True,
    )
    checkpoint.update(torch.load(meta, map_location="cpu", weights_only=False))
    torch.save(checkpoint, file)
