"""Helpers shared by the test modules (importable in spawned processes too)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_skrull.attention import comm


@dataclasses.dataclass(frozen=True)
class ExchangedTensor:
    """One tensor handed to a collective of the attention's K/V exchange.

    Attributes:
        collective: ``"all_gather"`` (forward) or ``"reduce_scatter"`` (backward).
        role: ``"input"`` (what this rank contributes) or ``"output"`` (what it gets back).
        dtype: the tensor's dtype.
        nbytes: its size in bytes.
    """

    collective: str
    role: str
    dtype: torch.dtype
    nbytes: int


class ExchangeLog:
    """What :func:`count_exchanged_bytes` recorded, in call order."""

    def __init__(self) -> None:
        self.tensors: list[ExchangedTensor] = []

    def record(self, collective: str, output: torch.Tensor, input: torch.Tensor) -> None:
        """Log the input and output of one collective call."""
        for role, t in (("input", input), ("output", output)):
            self.tensors.append(
                ExchangedTensor(collective, role, t.dtype, t.numel() * t.element_size())
            )

    @property
    def dtypes(self) -> set[torch.dtype]:
        """Every dtype exchanged."""
        return {t.dtype for t in self.tensors}

    @property
    def calls(self) -> dict[str, int]:
        """Number of calls per collective."""
        counts = {"all_gather": 0, "reduce_scatter": 0}
        for t in self.tensors:
            if t.role == "input":
                counts[t.collective] += 1
        return counts

    def total_bytes(self, collective: str | None = None, role: str | None = None) -> int:
        """Bytes of the recorded tensors, optionally of one collective and/or one role."""
        return sum(
            t.nbytes
            for t in self.tensors
            if (collective is None or t.collective == collective)
            and (role is None or t.role == role)
        )


@contextmanager
def count_exchanged_bytes() -> Iterator[ExchangeLog]:
    """Record (dtype, bytes) of every tensor the attention's K/V exchange passes to a collective.

    Wraps ``lightning_skrull.attention.comm._all_gather`` (forward) and ``_reduce_scatter``
    (backward) for the ``with`` block, in this process only (enter it inside a spawned
    process to count that rank's exchange). The collectives still run. A backward that runs
    after the block is not counted.

    Example::

        with count_exchanged_bytes() as log:
            model(**batch).loss.backward()
        assert log.dtypes == {torch.bfloat16}
    """
    log = ExchangeLog()
    real_gather, real_scatter = comm._all_gather, comm._reduce_scatter

    def gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
        log.record("all_gather", output, input)
        return real_gather(output, input, group)

    def scatter(output: torch.Tensor, input: torch.Tensor, group: Any) -> Any:
        log.record("reduce_scatter", output, input)
        return real_scatter(output, input, group)

    comm._all_gather, comm._reduce_scatter = gather, scatter
    try:
        yield log
    finally:
        comm._all_gather, comm._reduce_scatter = real_gather, real_scatter


# ----------------------------------------------------------------------------- tiny models
TINY_QWEN2: dict[str, Any] = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
"""A Qwen2 small enough for multi-process CPU tests (two layers, GQA, untied head)."""


def reference_logits(
    model: torch.nn.Module, sample: dict[str, list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits [T, V] in float32, shifted target [T])`` of one sample through a plain HF model,
    one sequence alone (the independent reference of the parity tests)."""
    ids = torch.tensor(sample["input_ids"])[None]
    labels = torch.tensor(sample["labels"])
    target = torch.full_like(labels, -100)
    target[:-1] = labels[1:]
    return model(ids).logits[0].float(), target


def token_loss_sum(
    model: torch.nn.Module, sample: dict[str, list[int]]
) -> tuple[torch.Tensor, int]:
    """``(summed token cross-entropy, supervised tokens)`` of one sample, one sequence alone."""
    logits, target = reference_logits(model, sample)
    loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum")
    return loss, int((target != -100).sum())


def cpu_trainer(strategy: Any, **kwargs: Any) -> Any:
    """A quiet CPU ``Trainer`` over this process group's ranks (one process without one)."""
    import lightning.pytorch as L
    import torch.distributed as dist

    defaults: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": dist.get_world_size() if dist.is_initialized() else 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    defaults.update(kwargs)
    return L.Trainer(strategy=strategy, **defaults)
