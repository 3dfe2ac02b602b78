"""The meetings of :meth:`SkrullFSDPStrategy.generating
<lightning_skrull.strategies.fsdp.SkrullFSDPStrategy.generating>`: the ranks generating from a
sharded model meet before each ``generate`` call's first collective, each forward called on the
model directly and the block's exit, so a rank calling the model alone or once more than the
others raises instead of hanging in an all-gather.

The rest of generating from a sharded model (``synced_gpus=True``, freeing the parameters FSDP2
left gathered on exit) is :func:`~lightning_skrull.models.plain_attention`'s, which the block
runs in, so a direct ``plain_attention(model)`` on a sharded model gets it too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, cast

import torch.distributed as dist
from torch import nn

from lightning_skrull.runtime.process_groups import as_member, once_per_world

_GENERATE, _FORWARD, _RAISED, _LEAVING, _LEAVING_BY_EXCEPTION = 0, 1, 2, 3, 4
"""Where a rank is when the ranks meet inside :meth:`SkrullFSDPStrategy.generating`: at the
first collective of a ``generate`` call, at a forward called on the model directly, out of a
``generate`` call that raised before its first collective, or leaving the block (normally or by
an exception)."""


class _ModelCalls:
    """One rank's calls of the model inside :meth:`SkrullFSDPStrategy.generating` (``generate``
    and forwards called directly), checked against the other ranks' before each call's first
    collective and at the block's exit.

    Each meeting all-gathers ``(where, generate calls, forwards, error)`` of every rank over the
    strategy's gloo group, whose timeout is :attr:`SkrullFSDPStrategy.generation_timeout`. A
    ``generate`` call meets when it reaches its first collective: its first forward (which
    all-gathers the sharded parameters), or the ``synced_gpus`` all-reduce of its decoding loop
    if that comes first; a call that raises before then (arguments that transformers'
    ``generate`` refuses on this rank only) meets with its error instead. A forward called on
    the model directly (a perplexity on the prompts, say) meets before it runs. Every rank
    raises at a meeting, before any forward of that call, when one rank's ``generate`` raised
    (that rank its own error, the others a ``RuntimeError`` carrying it) or when the ranks are at
    different points (one at its second ``generate`` call, another leaving after one); the ranks
    stay paired, so a run that catches the error on every rank trains on as if the block had not
    run. After a disagreement the block meets no more (a later call raises at once); after a
    ``generate`` that raised, the ranks agree on where they are and may call the model again.
    A ``generate`` or direct forward that raises after its first collective leaves without
    meeting (the others are inside its all-gathers): the error ends this process, and their
    collectives with it. Caught, it is recorded in :attr:`out_of_step`, and the strategy
    refuses the rank anything with collectives from then on. A meeting that times out raises
    too; gloo then closes the group's connections, so later blocks of the run raise at once.
    """

    def __init__(
        self, group: dist.ProcessGroup, timeout: float, rank: int, model: nn.Module
    ) -> None:
        self._group = group
        self._timeout = timeout
        self._rank = rank
        self._model = model
        self.calls = 0
        """``generate`` calls the ranks agreed on so far."""
        self.forwards = 0
        """Forwards called directly that the ranks agreed on so far."""
        self._failure: str | None = None
        self._generate_call: int | None = None
        """The ``generate`` call running, until it met the others."""
        self._generating = False
        """Inside a ``generate`` call (its later forwards do not meet)."""
        self._running = False
        """The ``generate`` call or direct forward met the others and went on into its
        collectives."""
        self.out_of_step: str | None = None
        """The call that raised in the middle of its collectives, leaving the others inside
        them: this rank's collectives no longer pair with theirs."""

    def before_forward(self, module: nn.Module, args: Any) -> None:
        """Forward pre-hook of the model for the whole block (before FSDP2's own, which
        all-gathers): the first forward of a ``generate`` call, or a direct forward, meets."""
        if self._generate_call is not None:
            self._begin_generate_call()
        elif not self._generating:
            self._meet(_FORWARD, self.calls, self.forwards + 1)
            self.forwards += 1
            self._running = True

    def _begin_generate_call(self) -> None:
        """The running ``generate`` call reached its first collective: meet the others there,
        then let it run into its collectives."""
        call = self._generate_call
        if call is not None:
            self._generate_call = None
            self._meet(_GENERATE, call, self.forwards)
            self._running = True

    def after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Forward hook of the model for the whole block: a direct forward ended."""
        if not self._generating:
            self._running = False

    def wrap(self, generate: Callable[..., Any]) -> Callable[..., Any]:
        """``generate`` meeting the other ranks at its first collective."""

        @functools.wraps(generate)
        def checked_generate(*args: Any, **kwargs: Any) -> Any:
            # generate(synced_gpus=False) is refused before any forward, on this rank alone
            if kwargs.get("synced_gpus", True) is False:
                return generate(*args, **kwargs)
            if self._failure is not None:
                self._refuse_after_failure()
            call = self.calls + 1
            self._generate_call, self._generating, self._running = call, True, False
            model = self._model
            # the synced_gpus all-reduce of the decoding loop (after the first forward in
            # transformers' greedy, sampling and beam search; before it in assisted decoding)
            unfinished = getattr(model, "_has_unfinished_sequences", None)
            if unfinished is not None:

                def meet_before_all_reduce(*a: Any, **k: Any) -> Any:
                    self._begin_generate_call()
                    return cast(Callable[..., Any], unfinished)(*a, **k)

                vars(model)["_has_unfinished_sequences"] = meet_before_all_reduce
            try:
                out = generate(*args, **kwargs)
                self._begin_generate_call()  # no collective ran: nor may the others'
            except Exception as err:
                if self._generate_call is not None:  # raised before any collective of the call
                    self._generate_call = None
                    self._meet(_RAISED, call, self.forwards, f"{type(err).__name__}: {err}")
                elif self._running:
                    # raised in the middle of the call: the other ranks are inside its
                    # all-gathers, which no meeting reaches. The block meets no more, so the
                    # error leaves at once and ends this process, and with it the others'
                    # collectives (an exit meeting would hold it for generation_timeout)
                    self._failure = f"generate raised after its first forward ({err})"
                    self.out_of_step = f"generate call {call} raised after its first forward"
                    self.out_of_step += f" ({type(err).__name__}: {err})"
                raise
            finally:
                self._generating = self._running = False
                vars(model).pop("_has_unfinished_sequences", None)
                self.calls = call
            return out

        return checked_generate

    def leave(self, where: int) -> None:
        """Meet the other ranks at the block's exit, unless a meeting of the block failed or a
        call raised after its first collective (the others are inside its all-gathers, which
        no meeting reaches: the error ends this process, and their collectives with it)."""
        if self._running:  # a direct forward met the others and never returned
            self.out_of_step = f"forward {self.forwards}, called directly, raised"
            self._failure = "a direct forward raised after it met the others"
        if self._failure is None:
            self._meet(where, self.calls, self.forwards)

    def _refuse_after_failure(self) -> None:
        raise RuntimeError(
            f"SkrullFSDPStrategy.generating() on global rank {self._rank}: the model was "
            f"called again after the block failed ({self._failure}); leave the block."
        )

    def _meet(self, where: int, calls: int, forwards: int, error: str = "") -> None:
        if self._failure is not None:
            self._refuse_after_failure()
        every: list[Any] = [None] * dist.get_world_size(self._group)
        try:
            dist.all_gather_object(every, (where, calls, forwards, error), group=self._group)
        except RuntimeError as err:
            self._failure = "a rank did not come"
            raise RuntimeError(
                f"SkrullFSDPStrategy.generating() on global rank {self._rank} "
                f"({_point(where, calls, forwards)}): not every rank came within "
                f"{self._timeout:g} s ({err}). Each forward of the model all-gathers the "
                "sharded parameters from every rank, so the ranks must reach each generate "
                "call, each forward called directly and the end of the block together; a rank "
                "is stuck or slow inside the block, or has died. A timeout closes the gloo "
                "group's connections, so this run cannot generate again: stop it, and raise "
                "SkrullFSDPStrategy.generation_timeout if a rank is merely slow."
            ) from err
        points = [(int(w), int(c), int(f), str(e)) for w, c, f, e in every]
        raised = [(rank, e) for rank, (w, _, _, e) in enumerate(points) if w == _RAISED]
        keys = {(_kind(w), c, f) for w, c, f, _ in points}
        if len(keys) == 1 and raised:
            if where == _RAISED:
                return  # this rank raises its own error
            errors = "; ".join(f"rank {rank}: {e}" for rank, e in raised)
            raise RuntimeError(
                f"SkrullFSDPStrategy.generating() on global rank {self._rank}: generate call "
                f"{calls} raised on rank{'s' * (len(raised) > 1)} "
                f"{', '.join(str(r) for r, _ in raised)} before its first forward ({errors}). "
                "This rank's call stops too, before any forward of it: each forward of "
                "generate all-gathers the sharded parameters from every rank, and the ranks "
                "that raised would not join. Fix that call's arguments on those ranks. The "
                "ranks stay paired: a run that catches this on every rank trains on "
                "unchanged, and may call generate again inside the block."
            )
        if len(keys) == 1:
            return
        self._failure = "the ranks called the model different numbers of times"
        ranks: dict[str, list[str]] = {}
        for rank, (w, c, f, _) in enumerate(points):
            ranks.setdefault(_point(w, c, f), []).append(str(rank))
        where_ranks = "; ".join(
            f"rank{'s' * (len(r) > 1)} {', '.join(r)}: {p}" for p, r in ranks.items()
        )
        raise RuntimeError(
            f"SkrullFSDPStrategy.generating() on global rank {self._rank}: the ranks called "
            f"generate or the model different numbers of times ({where_ranks}). Each forward "
            "all-gathers the sharded parameters from every rank, so a rank calling the model "
            "more often than the others would wait for them forever. Call generate, and the "
            "model itself, the same number of times and in the same order on every rank "
            "inside the block (the prompts and max_new_tokens may differ: give every rank the "
            "same number of prompt batches). Every rank raises this before any forward of "
            "the call, so a run that catches it on every rank trains on unchanged."
        )


def _out_of_step_message(rank: int, call: str) -> str:
    """Why a rank whose model call raised inside :meth:`SkrullFSDPStrategy.generating` in the
    middle of its collectives may not train, validate, save or generate again."""
    return (
        f"SkrullFSDPStrategy on global rank {rank}: inside generating(), {call} on this rank "
        "while the other ranks were inside its parameter all-gathers, and the error was "
        "caught. This rank's collectives no longer pair with theirs: a step, a checkpoint or "
        "another generate call would exchange the wrong tensors with them or wait forever, "
        "so the run ends here. Let an error inside generating() end the run (do not catch "
        "it), fix its cause, and resume from the last checkpoint."
    )


def _kind(where: int) -> int:
    """What must agree between the ranks at a meeting: a ``generate`` call (raised or not), a
    direct forward, or the exit (by an exception or not)."""
    if where == _RAISED:
        return _GENERATE
    if where == _LEAVING_BY_EXCEPTION:
        return _LEAVING
    return where


def _point(where: int, calls: int, forwards: int) -> str:
    """Where a rank is inside :meth:`SkrullFSDPStrategy.generating`, in words."""
    if where == _GENERATE:
        return f"generate call {calls}"
    if where == _RAISED:
        return f"generate call {calls}, raised before its first forward"
    if where == _FORWARD:
        return f"forward {forwards}, called directly"
    how = " by an exception" if where == _LEAVING_BY_EXCEPTION else ""
    done = f"{calls} generate call{'s' * (calls != 1)}"
    if forwards:
        done += f" and {forwards} direct forward{'s' * (forwards != 1)}"
    return f"leaving the block{how} after {done}"


class GenerationMeetings:
    """Where the ranks of :meth:`SkrullFSDPStrategy.generating` meet: a gloo group with its
    timeout, on which they meet on entry (``monitored_barrier``) and, for each block, at each
    call of the model (:class:`_ModelCalls`).

    Args:
        group: the gloo group of every rank, whose own timeout is ``timeout``.
        timeout: seconds a meeting waits for every rank before it raises.
        rank: this process's global rank (named in the messages).
    """

    def __init__(self, *, group: dist.ProcessGroup, timeout: float, rank: int) -> None:
        self._group = group
        self._timeout = timeout
        self._rank = rank

    @classmethod
    def of_world(cls, *, timeout: float, rank: int) -> GenerationMeetings:
        """The meetings of every rank of the default group, on a gloo group made once per world
        and timeout. A collective: every rank builds it in the same order.

        The group's own timeout bounds what ``monitored_barrier`` leaves to it (the wait of
        ranks other than 0) and the all-gathers of :class:`_ModelCalls`; gloo's default is 30
        min.
        """
        delta = timedelta(seconds=timeout)
        group = once_per_world(
            ("gloo", delta),
            lambda: as_member(dist.new_group(backend="gloo", timeout=delta)),
        )
        return cls(group=group, timeout=timeout, rank=rank)

    def enter(self) -> None:
        """Meet every rank on entry to the block.

        Raises:
            RuntimeError: a rank did not enter within the timeout (the message names the fix).
        """
        try:
            dist.monitored_barrier(
                self._group, timeout=timedelta(seconds=self._timeout), wait_all_ranks=True
            )
        except RuntimeError as err:
            raise RuntimeError(
                f"SkrullFSDPStrategy.generating() on global rank {self._rank}: not every "
                f"rank entered the block within {self._timeout:g} s ({err}). The "
                "parameters are sharded, so each forward of generate all-gathers them from the "
                "other ranks, and a rank that generates alone would hang. Enter "
                "trainer.strategy.generating() and call generate on every rank (drop an `if "
                "trainer.is_global_zero:` guard around it; the prompts and max_new_tokens may "
                "differ) and log the output on rank 0 only; or raise "
                "SkrullFSDPStrategy.generation_timeout if a rank is merely slow. A timeout "
                "closes the gloo group's connections: after one, every later block of the run "
                "raises at once (with 'pair closure' or 'Connection closed by peer' above)."
            ) from err

    @contextmanager
    def around_calls(
        self, model: nn.Module, out_of_step: Callable[[str, bool], None]
    ) -> Iterator[None]:
        """Meet the other ranks at each call of ``model`` inside the block and at its exit.

        ``model.generate`` (:func:`~lightning_skrull.models.plain_attention`'s, with
        ``synced_gpus=True``) becomes, on the instance, one that meets the others at its first
        collective; whoever set up the block takes the instance attribute off on exit
        (:func:`~lightning_skrull.models.plain_attention` does). A call that raised on this
        rank in the middle of its collectives is reported on exit to
        ``out_of_step(message, caught)``: ``message`` says why the rank may do nothing with
        collectives any more, ``caught`` whether the block itself ended normally (the error was
        caught inside it).
        """
        calls = _ModelCalls(self._group, self._timeout, self._rank, model)
        vars(model)["generate"] = calls.wrap(cast(Any, model).generate)
        hooks = (
            model.register_forward_pre_hook(calls.before_forward, prepend=True),
            model.register_forward_hook(calls.after_forward),
        )
        leaving = _LEAVING_BY_EXCEPTION
        try:
            yield
            leaving = _LEAVING
        finally:
            for hook in hooks:
                hook.remove()
            calls.leave(leaving)
            if calls.out_of_step is not None:
                message = _out_of_step_message(self._rank, calls.out_of_step)
                out_of_step(message, leaving == _LEAVING)
