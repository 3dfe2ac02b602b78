"""Global batches of sample indices: one list per optimizer step, the same on every rank.

Every rank builds the same :class:`GlobalBatchSampler` and draws the same batches without any
communication: the order of an epoch depends only on ``(seed, epoch)``, never on global random
state. The sampler knows nothing about ranks; each rank later takes its own part of the plan
made from the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch.utils.data

_STATE_KEYS = ("num_samples", "global_batch_size", "shuffle", "drop_last", "seed", "epoch")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}.")
    return int(value)


class GlobalBatchSampler(torch.utils.data.Sampler[list[int]]):
    """Yields the sample indices of each global batch (one optimizer step) of an epoch.

    With ``shuffle=False`` batch ``k`` is ``[k*G, ..., k*G + G - 1]`` (``G`` =
    ``global_batch_size``); with ``shuffle=True`` the same cut is applied to a permutation drawn
    from ``(seed, epoch)``. The last batch holds the ``num_samples % G`` remaining samples unless
    ``drop_last``. Each index appears exactly once per epoch (or not at all when dropped).

    Call :meth:`set_epoch` at the start of every epoch (Lightning does it for samplers it can
    see). :meth:`state_dict` / :meth:`load_state_dict` save and restore the position inside an
    epoch, so a resumed run continues with exactly the batches it would have had.

    Args:
        num_samples: size of the dataset.
        global_batch_size: samples per optimizer step, over all ranks.
        shuffle: draw a new order each epoch; ``False`` keeps dataset order.
        seed: base seed of the shuffle; the same on every rank.
        drop_last: drop the final partial batch instead of training on it.

    Raises:
        TypeError: a non-int count or seed.
        ValueError: ``num_samples < 1``, ``global_batch_size < 1``, or ``drop_last`` with fewer
            samples than one batch (the epoch would be empty).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        self.num_samples = _check_int("num_samples", num_samples, 1)
        self.global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        if self.drop_last and self.global_batch_size > self.num_samples:
            raise ValueError(
                f"drop_last=True with global_batch_size = {self.global_batch_size} > "
                f"{self.num_samples} samples leaves no batch to train; lower global_batch_size "
                "or set drop_last=False."
            )
        self._epoch = 0
        self._yielded = 0
        self._resume_from = 0

    # ------------------------------------------------------------------ epochs
    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration draws."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch to draw; a new epoch starts from its first batch.

        Setting the epoch that is already current keeps a position restored by
        :meth:`load_state_dict`, so ``load_state_dict(...)`` followed by Lightning's
        ``set_epoch(same_epoch)`` resumes mid-epoch.
        """
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._yielded = 0
            self._resume_from = 0

    def epoch_order(self, epoch: int | None = None) -> list[int]:
        """Every sample index in the order of ``epoch`` (default: the current epoch)."""
        epoch = self._epoch if epoch is None else _check_int("epoch", epoch, 0)
        if not self.shuffle:
            return list(range(self.num_samples))
        rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
        return rng.permutation(self.num_samples).tolist()

    # --------------------------------------------------------------- iteration
    def __len__(self) -> int:
        """Global batches in one whole epoch (a resumed epoch yields only the rest)."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order()
        size = self.global_batch_size
        first = self._resume_from
        self._resume_from = 0  # a position restored by load_state_dict applies once
        self._yielded = first
        for batch in range(first, len(self)):
            self._yielded = batch + 1
            yield order[batch * size : (batch + 1) * size]

    @property
    def batches_yielded(self) -> int:
        """Batches of the current epoch handed out so far (including any skipped on resume)."""
        return self._yielded

    # ------------------------------------------------------------------- state
    def state_dict(self, *, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position to resume from.

        Args:
            batches_consumed: batches of the current epoch actually trained. A consumer that
                fetches ahead (Lightning prefetches one batch) must pass its own count; by
                default the number of batches yielded so far is saved.

        Returns:
            A plain dict: the constructor arguments, ``epoch`` and ``batches_consumed``.
        """
        if batches_consumed is None:
            batches_consumed = max(self._yielded, self._resume_from)
        else:
            batches_consumed = _check_int("batches_consumed", batches_consumed, 0)
            if batches_consumed > len(self):
                raise ValueError(
                    f"batches_consumed = {batches_consumed} exceeds the {len(self)} batches of an "
                    "epoch; pass the number of batches trained in the current epoch."
                )
        return {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "seed": self.seed,
            "epoch": self._epoch,
            "batches_consumed": batches_consumed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores a position saved by :meth:`state_dict`; the next iteration continues there.

        The saved seed and epoch replace the current ones. The dataset size, batch size,
        ``shuffle`` and ``drop_last`` must match the saved run, or the resumed batches would
        differ.

        Raises:
            ValueError: a missing key, or a setting that differs from the saved run.
        """
        missing = [k for k in (*_STATE_KEYS, "batches_consumed") if k not in state]
        if missing:
            raise ValueError(
                f"GlobalBatchSampler state lacks {missing}; pass a dict made by state_dict()."
            )
        for key in ("num_samples", "global_batch_size", "shuffle", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"Cannot resume: the saved run had {key} = {state[key]!r}, this one has "
                    f"{getattr(self, key)!r}, so the remaining batches would differ. Resume with "
                    f"the same data and {key} = {state[key]!r}."
                )
        consumed = _check_int("batches_consumed", state["batches_consumed"], 0)
        if consumed > len(self):
            raise ValueError(
                f"batches_consumed = {consumed} exceeds the {len(self)} batches of an epoch; the "
                "state does not belong to this dataset."
            )
        self.seed = _check_int("seed", state["seed"], 0)
        self._epoch = _check_int("epoch", state["epoch"], 0)
        self._resume_from = consumed
        self._yielded = consumed

    def __repr__(self) -> str:
        return (
            f"GlobalBatchSampler(num_samples={self.num_samples}, "
            f"global_batch_size={self.global_batch_size}, shuffle={self.shuffle}, "
            f"seed={self.seed}, drop_last={self.drop_last}, epoch={self._epoch})"
        )
