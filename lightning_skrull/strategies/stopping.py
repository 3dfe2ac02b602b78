"""``trainer.should_stop`` set on some ranks only stops every rank.

Lightning reads ``trainer.should_stop`` on each rank by itself: a rank that sets it (a NaN guard
in ``training_step``, a callback deciding on rank 0 only) leaves the fit or starts a validation
while the others go on to the next step, and every rank then waits in collectives the others
never join. Lightning's own ``EarlyStopping`` agrees first (``reduce_boolean_decision``); user
code often does not.

:class:`StopAgreement` makes the ranks agree wherever the fit loop is about to read the flag:
after each training step (before Lightning decides whether to validate), after each validation
in a fit, and after each epoch's end hooks. Any rank's ``True`` becomes every rank's, so all
ranks stop together, as one process would stop. Each agreement is one all-reduce of one integer
per rank.

``LightningModule.on_train_batch_start`` returning ``-1`` ends the epoch the same way, on the
rank that returns it: where the module overrides the hook, the ranks agree on its answer too
(one more all-reduce per step, for those modules only), and any rank's ``-1`` skips the rest of
the epoch on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info


class StopAgreement:
    """Agrees on ``trainer.should_stop`` over the default process group during a fit.

    Args:
        trainer: the fitting Trainer.
        device: where the strategy's collectives run (its root device).
        name: the strategy's name, for the message.
        check: called before each agreement's collective; raises to refuse it.
    """

    def __init__(
        self, trainer: pl.Trainer, device: torch.device, name: str, check: Callable[[], None]
    ) -> None:
        self._trainer = trainer
        self._device = device
        self._name = name
        self._check = check
        self._told = False
        self._wrapped: list[Any] = []  # the loops whose on_advance_end is wrapped
        self._told_skip = False
        self._hook: tuple[Any, Any] | None = None  # (module, its own instance attribute or None)

    def attach(self) -> None:
        """Agree after each training step and after each epoch's end hooks (the fit loop's
        ``on_advance_end`` of the epoch and of the fit; Lightning has no hook after them)."""
        fit_loop = self._trainer.fit_loop
        self._wrap(fit_loop.epoch_loop, before=True)
        self._wrap(fit_loop, before=False)
        module = self._trainer.lightning_module
        if is_overridden("on_train_batch_start", module, pl.LightningModule):
            self._hook = (module, vars(module).get("on_train_batch_start"))
            original = module.on_train_batch_start

            def on_train_batch_start(*args: Any, **kwargs: Any) -> Any:
                response = original(*args, **kwargs)
                return -1 if self._agree_on_skip(response == -1) else response

            module.on_train_batch_start = on_train_batch_start  # type: ignore[method-assign]

    def detach(self) -> None:
        for loop in self._wrapped:
            del loop.on_advance_end  # the instance attribute; the class's method again
        self._wrapped = []
        if self._hook is not None:
            module, own = self._hook
            if own is None:
                del module.on_train_batch_start
            else:
                module.on_train_batch_start = own
            self._hook = None

    def _wrap(self, loop: Any, *, before: bool) -> None:
        original = loop.on_advance_end

        def on_advance_end(*args: Any, **kwargs: Any) -> Any:
            if before:
                self.agree()
                return original(*args, **kwargs)
            out = original(*args, **kwargs)
            self.agree()
            return out

        loop.on_advance_end = on_advance_end
        self._wrapped.append(loop)

    def _ranks_with(self, flag: bool) -> list[int]:
        """The ranks whose ``flag`` is set, from one all-reduce of an integer per rank."""
        self._check()
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=self._device)
        flags[dist.get_rank()] = int(flag)
        dist.all_reduce(flags)
        return [rank for rank, set_ in enumerate(flags.tolist()) if set_]

    def _agree_on_skip(self, skip: bool) -> bool:
        """Whether any rank's ``on_train_batch_start`` returned ``-1`` for this batch."""
        ranks = self._ranks_with(skip)
        if ranks and len(ranks) < dist.get_world_size() and not self._told_skip:
            self._told_skip = True
            rank_zero_info(
                f"{self._name}: on_train_batch_start returned -1 on rank(s) "
                f"{', '.join(map(str, ranks))} only, at global step "
                f"{self._trainer.global_step}; every rank skips the rest of the epoch (a rank "
                "skipping alone would leave the others waiting in their collectives)."
            )
        return bool(ranks)

    def agree(self) -> None:
        """Every rank's ``trainer.should_stop`` becomes ``True`` if any rank's is."""
        trainer = self._trainer
        ranks = self._ranks_with(bool(trainer.should_stop))
        if not ranks:
            return
        if len(ranks) < dist.get_world_size() and not self._told:
            self._told = True
            rank_zero_info(
                f"{self._name}: trainer.should_stop was set on rank(s) "
                f"{', '.join(map(str, ranks))} only, at global step {trainer.global_step}; "
                "every rank stops (a rank stopping alone would leave the others waiting in "
                "their collectives)."
            )
        trainer.should_stop = True
