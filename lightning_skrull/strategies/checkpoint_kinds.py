"""Which strategy wrote a checkpoint, read from its files, so a strategy given another's refuses
it with the way forward instead of failing inside ``torch.load`` or DeepSpeed.

- ``"file"``: one file (``SkrullStrategy``, ``SkrullFSDPStrategy(save_distributed_checkpoint=
  False)``); ``SkrullStrategy`` and ``SkrullFSDPStrategy`` resume from it, on any layout.
- ``"distributed"``: a folder of ``torch.distributed.checkpoint`` shards with its ``.metadata``
  (``SkrullFSDPStrategy``'s default); only ``SkrullFSDPStrategy`` resumes from it.
- ``"deepspeed"``: a DeepSpeed folder with its ``latest`` tag (``SkrullZero2Strategy``); only
  ``SkrullZero2Strategy`` resumes from it, on the process count that wrote it.
- ``"folder"``: any other folder.

Pure: reads file names only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

CheckpointKind = Literal["file", "distributed", "deepspeed", "folder"]

_NAME: dict[CheckpointKind, str] = {
    "file": "a single checkpoint file",
    "distributed": "a folder of torch.distributed.checkpoint shards",
    "deepspeed": "a DeepSpeed checkpoint folder",
    "folder": "a folder that is neither a torch.distributed.checkpoint nor a DeepSpeed one",
}
_WRITTEN_BY: dict[CheckpointKind, str] = {
    "file": ", as SkrullStrategy and SkrullFSDPStrategy(save_distributed_checkpoint=False) write",
    "distributed": (
        ", as SkrullFSDPStrategy writes (save_distributed_checkpoint=True, the default)"
    ),
    "deepspeed": ", as SkrullZero2Strategy writes",
    "folder": "",
}
_FIX: dict[CheckpointKind, str] = {
    "file": (
        "Resume it with SkrullStrategy or SkrullFSDPStrategy (both read it, on any layout); or "
        "start a new fit of this strategy from its weights (LightningModule.load_from_checkpoint"
        "(file)), without its optimizer state."
    ),
    "distributed": (
        "Resume it with SkrullFSDPStrategy (on any layout); or write it as one file with "
        "SkrullFSDPStrategy.consolidate_checkpoint(folder, file) on one process and start a new "
        "fit from its weights (LightningModule.load_from_checkpoint(file)): the optimizer state "
        "in that file stays keyed for FSDP. To resume with SkrullStrategy later, train with "
        "SkrullFSDPStrategy(save_distributed_checkpoint=False), whose files it reads."
    ),
    "deepspeed": (
        "Its optimizer state is ZeRO-2's partitions, which only SkrullZero2Strategy reads, on "
        "the process count that wrote it: resume it with SkrullZero2Strategy; or write its "
        "weights as one file with lightning.pytorch.utilities.deepspeed."
        "convert_zero_checkpoint_to_fp32_state_dict(folder, file) and start a new fit from them "
        "(LightningModule.load_from_checkpoint(file)), without the optimizer state."
    ),
    "folder": "Pass the checkpoint file or folder that a Trainer wrote.",
}


def checkpoint_kind(path: str | Path) -> CheckpointKind:
    """The kind of the checkpoint at ``path`` (an existing file or folder)."""
    path = Path(path)
    if not path.is_dir():
        return "file"
    if (path / ".metadata").is_file():
        return "distributed"
    if (path / "latest").is_file():
        return "deepspeed"
    return "folder"


def refuse_other_kind(strategy: str, path: str | Path, reads: tuple[CheckpointKind, ...]) -> None:
    """Refuse the checkpoint at ``path`` unless its kind is one ``strategy`` ``reads``.

    Raises:
        ValueError: naming the checkpoint, what wrote it, what ``strategy`` reads and the fix.
    """
    if not Path(path).exists():
        return  # Lightning's own error names the missing path
    kind = checkpoint_kind(path)
    if kind in reads:
        return
    readable = " or ".join(_NAME[k] for k in reads)
    raise ValueError(
        f"{strategy} cannot read the checkpoint {str(path)!r}: it is {_NAME[kind]}"
        f"{_WRITTEN_BY[kind]}, and {strategy} reads {readable}. {_FIX[kind]}"
    )
