"""Generation in the middle of training: ``trainer.strategy.generating()`` and
``lightning_skrull.models.plain_attention``.

One spawn of 4 processes, DP=2 x CP=2, runs every Trainer case. A callback generates greedy
tokens from fixed prompts at the end of step 1 (``on_train_batch_end``), inside
``trainer.strategy.generating()``, and records the parameters it generated from:

- ``SkrullStrategy`` (DDP), float32: global rank 0 generates alone, the other ranks go on to
  step 2 (no collective may pair up wrongly);
- ``SkrullFSDPStrategy`` (HSDP, parameters sharded over the CP group), float32: every rank
  generates, from its own prompt and with its own number of new tokens (3 + rank), so the ranks
  finish at different forwards and only ``synced_gpus=True`` (passed by the strategy;
  ``synced_gpus=False`` is refused) keeps their all-gathers paired; before that, a ``generate``
  call that transformers refuses on rank 1 only (``max_new_tokens=0``) stops every rank's call
  before its first forward;
- ``SkrullZero2Strategy``, float32: rank 0 alone;
- ``SkrullFSDPStrategy`` misused (:class:`MisusesGenerating`): ranks calling ``generate``
  2 and 1 times, refused on every rank at once with the same message naming each rank's point;
  rank 0, and in another run rank 3, entering ``generating()`` alone, refused on entry after
  the strategy's short timeout (rank 0's message names the ranks that did not come); rank 3
  reaching its first ``generate`` after the others' timeout, refused on every rank; a block
  after a timeout, refused at once. Each run then trains on unchanged (bit for bit);
- ``SkrullStrategy`` under ``"bf16-mixed"``: rank 0, in the validation step's autocast;
- a callback that switches the attention by hand (``set_attn_implementation("sdpa")``) and
  forgets to switch back: step 2 raises on every rank.

Two more spawns of 2 processes (DP=1 x CP=2, FSDP) have rank 1's generation raise at its
second token, and rank 1's direct forward raise in its first decoder layer: both processes must
end at once, with that error shown.

The generated tokens equal plain transformers ``generate`` (greedy, one process, eager
attention, float32; for bf16-mixed: sdpa under the same CPU autocast) on the parameters the
callback saw; the parameters after step 2 equal those of the same run without the callback
exactly (bit for bit: generation changed nothing the next step reads); the attention after the
block is ``"skrull"`` again. DP ranks run different micro-batch counts in these steps (asserted).

The single-process tests below check the context manager itself: a left-padded batch (which the
chunked loss's forward wrapper would get wrong), restoration on exceptions, nesting, models that
were never prepared, and the refusal inside a micro-batch.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from harness import full_state, one_rank_plan
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    PARAM_ATOL,
    BatchRecorder,
    PlainLM,
    cpu_trainer,
    generated,
    greedy_generation,
    make_data,
    make_samples,
    max_diff,
    output_cache,
    reference_model,
    reference_training,
    tiny_model,
    tiny_qwen2,
)

from lightning_skrull.models import ATTENTION_NAME, plain_attention, prepare_model
from lightning_skrull.models.chunked_loss import uses_chunked_loss
from lightning_skrull.runtime.launch import spawn

STEPS = 2
PROMPTS = ([5, 9, 2, 7], [3, 1, 4, 1, 5, 9, 2, 6, 11])
"""Rank ``r`` generates from ``PROMPTS[r % 2]``."""
MISUSE_TIMEOUTS = {"uneven": 2.0, "alone": 1.0, "late": 1.5}
"""``SkrullFSDPStrategy.generation_timeout`` of each misuse case of :class:`MisusesGenerating`."""
LATE_SLEEP = 2.5
"""Seconds rank 3 sleeps in the ``"late"`` case: past that case's timeout."""
# Float32 logits of the cached sdpa generation against the eager reference differ by summation
# order only (measured up to 6.0e-8 under DDP, FSDP and ZeRO-2); 1e-5 leaves room.
LOGITS_ATOL = 1e-5


def _new_tokens(rank: int) -> int:
    return 3 + rank


class SampleGenerations(L.Callback):
    """Generates greedily at the end of step 1 on ``ranks``, the way a user's callback does."""

    def __init__(self, ranks: tuple[int, ...]) -> None:
        self.ranks = ranks
        self.record: dict[str, Any] = {}

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rank = trainer.global_rank
        if batch_idx == 1 and len(self.ranks) > 1:
            # FSDP, after the last step: ranks 0 and 1 call the model directly twice, ranks 2
            # and 3 once; refused on every rank, and the parameters stay as trained
            self.record["uneven_forwards"] = _generate_in_block(
                trainer, 2 if rank < 2 else 1, direct=True
            )
        if batch_idx != 0:
            return
        self.record["params"] = full_state(module.model)  # every rank: a collective for FSDP
        if rank in self.ranks:
            prompt = torch.tensor([PROMPTS[rank % 2]])
            with trainer.strategy.generating() as model:
                self.record["inside"] = {
                    "attention": model.config._attn_implementation,
                    "training": model.training,
                    "grad": torch.is_grad_enabled(),
                    "is_hf_model": model is module.model,
                }
                try:  # refused before any forward, so no rank is left waiting
                    model.generate(prompt, max_new_tokens=1, synced_gpus=False)
                except ValueError as err:
                    self.record["unsynced"] = str(err)
                if len(self.ranks) > 1:
                    # FSDP: a forward called on the model directly (every rank, once)
                    self.record["forward_logits"] = model(prompt).logits.float().numpy()
                    # rank 1's arguments are refused by transformers before its first
                    # forward; every rank's call stops there, and the ranks generate on
                    start = time.perf_counter()
                    try:
                        model.generate(prompt, max_new_tokens=0 if rank == 1 else 2, pad_token_id=0)
                    except (ValueError, RuntimeError) as err:
                        self.record["raised"] = f"{type(err).__name__}: {err}"
                    self.record["raised_seconds"] = time.perf_counter() - start
                out = greedy_generation(model, prompt, _new_tokens(rank))
            self.record.update(generated(out))
            self.record["cache"] = output_cache(out) is not None
        self.record["after"] = {
            "attention": module.model.config._attn_implementation,
            "training": module.model.training,
            "chunked": uses_chunked_loss(module.model),
        }


def _generate_in_block(
    trainer: Any, calls: int, *, sleep: float = 0.0, again: bool = False, direct: bool = False
) -> dict[str, Any]:
    """Enter ``generating()``, sleep ``sleep`` s, call ``generate`` (``direct``: the model's
    forward) ``calls`` times; what came of it: the calls that returned, whether the block's body
    ran to its end, the error and the seconds it took. ``again``: after a refused call, call
    ``generate`` once more inside."""
    out: dict[str, Any] = {"returned": 0, "body_done": False}
    start = time.perf_counter()
    try:
        with trainer.strategy.generating() as model:
            time.sleep(sleep)
            for _ in range(calls):
                prompt = torch.tensor([PROMPTS[0]])
                try:
                    if direct:
                        model(prompt)
                    else:
                        model.generate(prompt, max_new_tokens=1, pad_token_id=0)
                except RuntimeError:
                    if again:
                        try:
                            model.generate(torch.tensor([PROMPTS[0]]), max_new_tokens=1)
                        except RuntimeError as err:
                            out["again"] = str(err)
                    raise
                out["returned"] += 1
            out["body_done"] = True
    except RuntimeError as err:
        out["error"] = str(err)
    out["seconds"] = time.perf_counter() - start
    return out


class MisusesGenerating(L.Callback):
    """Misuses ``generating()`` under FSDP in the ways that would hang in ``generate``.

    ``"uneven"``: after step 1 every rank enters the block, ranks 0 and 1 call ``generate``
    twice, ranks 2 and 3 once; then rank 0 enters alone; after step 2 every rank enters again.
    ``"alone"``: after step 1 rank 3 (not the rank ``monitored_barrier`` collects on) enters
    alone. ``"late"``: after step 1 every rank enters and rank 3 sleeps :data:`LATE_SLEEP` s
    before its ``generate``. Every error is caught, so the run trains on.
    """

    def __init__(self, case: str) -> None:
        self.case = case
        self.record: dict[str, Any] = {}

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        rank = trainer.global_rank
        if self.case == "uneven" and batch_idx == 0:
            self.record["uneven"] = _generate_in_block(trainer, 2 if rank < 2 else 1, again=True)
            if rank == 0:
                self.record["alone"] = _generate_in_block(trainer, 1)
        elif self.case == "uneven":
            self.record["after_timeout"] = _generate_in_block(trainer, 1)
        elif self.case == "alone" and batch_idx == 0 and rank == 3:
            self.record["alone"] = _generate_in_block(trainer, 1)
        elif self.case == "late" and batch_idx == 0:
            self.record["late"] = _generate_in_block(
                trainer, 1, sleep=LATE_SLEEP if rank == 3 else 0.0
            )


class ForgetsToSwitchBack(L.Callback):
    """Switches the attention by hand after step 1 and does not switch it back."""

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == 0:
            module.model.set_attn_implementation("sdpa")


def _fit(strategy: Any, callbacks: tuple[L.Callback, ...] = (), **kwargs: Any) -> Any:
    from lightning_skrull import SkrullDataModule

    recorder = BatchRecorder()
    trainer = cpu_trainer(strategy, max_steps=STEPS, callbacks=[recorder, *callbacks], **kwargs)
    module = PlainLM()
    data = SkrullDataModule(
        train_data=make_data(), global_batch_size=GLOBAL_BATCH, shuffle=False, seed=3
    )
    trainer.fit(module, data)
    return module, recorder


def _cases(rank: int, world_size: int) -> dict[str, Any]:
    from lightning_skrull import SkrullFSDPStrategy, SkrullStrategy, SkrullZero2Strategy

    # name: (strategy, ranks that generate, Trainer arguments, also run without the callback)
    strategies = {
        "ddp": (lambda: SkrullStrategy(cp_size=2, bucket_size=BUCKET), (0,), {}, True),
        "fsdp": (
            lambda: SkrullFSDPStrategy(cp_size=2, bucket_size=BUCKET),
            (0, 1, 2, 3),
            {},
            True,
        ),
        # DeepSpeed's start costs ~5 s a run: compared with the reference training instead
        "zero2": (lambda: SkrullZero2Strategy(cp_size=2, bucket_size=BUCKET), (0,), {}, False),
        "bf16": (
            lambda: SkrullStrategy(cp_size=2, bucket_size=BUCKET),
            (0,),
            {"precision": "bf16-mixed"},
            False,
        ),
    }
    out: dict[str, Any] = {}
    for name, (make, ranks, kwargs, baseline) in strategies.items():
        callback = SampleGenerations(ranks)
        module, recorder = _fit(make(), (callback,), **kwargs)
        out[name] = {
            **callback.record,
            "final": full_state(module.model),
            "planned": [s["planned"] for s in recorder.steps],
        }
        if baseline:
            plain, _ = _fit(make(), **kwargs)
            out[name]["final_without_callback"] = full_state(plain.model)
    # FSDP misused: every case is refused, on every rank, and the run trains on. A timeout
    # closes the gloo group's connections, and the group is made once per world and timeout:
    # each case that times out once has a timeout of its own
    for case, timeout in MISUSE_TIMEOUTS.items():
        misused = SkrullFSDPStrategy(cp_size=2, bucket_size=BUCKET)
        misused.generation_timeout = timeout
        callback_misuse = MisusesGenerating(case)
        module, _ = _fit(misused, (callback_misuse,))
        out[f"fsdp_{case}"] = {**callback_misuse.record, "final": full_state(module.model)}
    try:
        _fit(SkrullStrategy(cp_size=2, bucket_size=BUCKET), (ForgetsToSwitchBack(),))
    except RuntimeError as err:
        out["forgotten"] = str(err)
    else:
        out["forgotten"] = None
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return spawn(_cases, 4, timeout=600)


def _reference_generate(
    params: dict[str, np.ndarray], rank: int, attention: str = "eager"
) -> tuple[list[int], np.ndarray]:
    """Plain transformers' greedy ``generate`` of rank ``rank``'s prompt on ``params``."""
    model = reference_model()
    model.load_state_dict({k: torch.from_numpy(v).float() for k, v in params.items()})
    model.set_attn_implementation(attention)
    model.eval()
    out = model.generate(
        torch.tensor([PROMPTS[rank % 2]]),
        max_new_tokens=_new_tokens(rank),
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[0].tolist(), torch.stack(out.logits).float().numpy()


def _assert_unchanged_training(run: dict[str, Any]) -> None:
    """Parameters after step 2 equal the run without the callback bit for bit, or, where that
    run was left out (ZeRO-2), the single-process reference training to float32 rounding."""
    final = run["final"]
    if "final_without_callback" in run:
        without = run["final_without_callback"]
        assert final.keys() == without.keys()
        for key in final:
            assert np.array_equal(final[key], without[key]), f"{key} differs after step 2"
        return
    reference, _ = reference_training(STEPS)
    assert max_diff(final, reference) < PARAM_ATOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", ["ddp", "fsdp", "zero2"])
def test_generation_mid_training_equals_plain_transformers(
    runs: list[dict[str, Any]], name: str
) -> None:
    generating = [r for r in range(4) if "tokens" in runs[r][name]]
    assert generating == ([0, 1, 2, 3] if name == "fsdp" else [0])
    # the DP ranks trained different micro-batch counts in these steps
    assert runs[0][name]["planned"] != runs[2][name]["planned"]
    for rank in generating:
        run = runs[rank][name]
        assert run["inside"] == {
            "attention": "sdpa",
            "training": False,
            "grad": False,
            "is_hf_model": True,
        }
        assert run["cache"]
        # FSDP: synced_gpus=True is the only way (DDP and ZeRO-2 do not need it)
        assert ("unsynced" in run) == (name == "fsdp")
        if name == "fsdp":
            assert "generate(synced_gpus=False) on a model sharded by FSDP" in run["unsynced"]
        tokens, logits = _reference_generate(run["params"], rank)
        assert len(tokens) == len(PROMPTS[rank % 2]) + _new_tokens(rank)
        assert run["tokens"] == tokens
        np.testing.assert_allclose(run["logits"], logits, rtol=0, atol=LOGITS_ATOL)
    for rank in range(4):
        run = runs[rank][name]
        assert run["after"] == {"attention": ATTENTION_NAME, "training": True, "chunked": True}
        _assert_unchanged_training(run)
    # the ranks generated from the same parameters (FSDP: gathered from the shards)
    for rank in range(1, 4):
        for key, value in runs[0][name]["params"].items():
            assert np.array_equal(runs[rank][name]["params"][key], value)


@pytest.mark.multiprocess
def test_fsdp_generate_raising_on_one_rank_stops_every_rank_before_any_forward(
    runs: list[dict[str, Any]],
) -> None:
    # rank 1 called generate(max_new_tokens=0), which transformers refuses before the first
    # forward; ranks 0, 2 and 3 (valid arguments) stopped at their first forward with rank 1's
    # error, instead of waiting in the parameter all-gathers for the process group's timeout
    own = "ValueError: `max_new_tokens` must be greater than 0, but is 0."
    for rank in range(4):
        run = runs[rank]["fsdp"]
        if rank == 1:
            assert run["raised"] == own
        else:
            message = run["raised"]
            assert message.startswith(
                f"RuntimeError: SkrullFSDPStrategy.generating() on global rank {rank}: generate "
                f"call 1 raised on rank 1 before its first forward (rank 1: {own})"
            ), message
            assert "Fix that call's arguments on those ranks" in message
            assert "trains on unchanged" in message
        # at once: the generation timeout is 300 s here, gloo's group timeout 30 min; 10 s
        # leave room for a busy machine
        assert run["raised_seconds"] < 10.0
    # the ranks stayed paired: the next generate calls and the training after them are checked
    # against plain transformers and the run without the callback in
    # test_generation_mid_training_equals_plain_transformers


@pytest.mark.multiprocess
def test_fsdp_forwards_called_directly_are_met_and_counted(runs: list[dict[str, Any]]) -> None:
    # a forward called on the model inside the block (every rank) equals plain transformers'
    # forward on the parameters the callback saw
    for rank in range(4):
        run = runs[rank]["fsdp"]
        model = reference_model()
        model.load_state_dict({k: torch.from_numpy(v).float() for k, v in run["params"].items()})
        model.eval()
        with torch.no_grad():
            expected = model(torch.tensor([PROMPTS[rank % 2]])).logits.float().numpy()
        np.testing.assert_allclose(run["forward_logits"], expected, rtol=0, atol=LOGITS_ATOL)
    # after step 2, ranks 0 and 1 called the model twice, ranks 2 and 3 once: the second
    # forward of ranks 0 and 1 met the exit of ranks 2 and 3, and every rank got the same error
    # at once (the timeout is 300 s; 10 s leave room for a busy machine), before any all-gather
    where = (
        "(ranks 0, 1: forward 2, called directly; "
        "ranks 2, 3: leaving the block after 0 generate calls and 1 direct forward)"
    )
    for rank in range(4):
        run = runs[rank]["fsdp"]["uneven_forwards"]
        message = run["error"]
        assert "the ranks called generate or the model different numbers of times " + where in (
            message
        ), message
        assert f"on global rank {rank}:" in message
        assert run["returned"] == 1
        assert run["seconds"] < 10.0
    # the parameters after it equal the run without the callback bit for bit:
    # test_generation_mid_training_equals_plain_transformers


@pytest.mark.multiprocess
def test_generation_under_bf16_mixed_runs_in_the_validation_autocast(
    runs: list[dict[str, Any]],
) -> None:
    run = runs[0]["bf16"]
    # reference: the same weights and attention (sdpa), one process, in CPU bf16 autocast,
    # which is the validation step's precision under bf16-mixed: the same computation
    with torch.autocast("cpu", dtype=torch.bfloat16):
        tokens, logits = _reference_generate(run["params"], 0, attention="sdpa")
    assert run["tokens"] == tokens
    np.testing.assert_array_equal(run["logits"], logits)
    # and not float32: the logits of the same weights without autocast differ (measured 1.0e-3,
    # bf16 rounding of these small logits; float32 would differ by its rounding, ~1e-7)
    _, fp32_logits = _reference_generate(run["params"], 0, attention="sdpa")
    assert np.abs(run["logits"] - fp32_logits).max() > 1e-4
    for rank in range(4):
        assert runs[rank]["bf16"]["after"]["attention"] == ATTENTION_NAME


def _assert_trained_on(runs: list[dict[str, Any]], case: str) -> None:
    """The refused blocks changed nothing: the run trained on, equal to the one without the
    callback bit for bit (no rank ran a forward the others did not join)."""
    without = runs[0]["fsdp"]["final_without_callback"]
    for rank in range(4):
        final = runs[rank][f"fsdp_{case}"]["final"]
        assert final.keys() == without.keys()
        assert all(np.array_equal(final[k], without[k]) for k in without), (case, rank)


@pytest.mark.multiprocess
def test_fsdp_uneven_generate_calls_are_refused_on_every_rank(
    runs: list[dict[str, Any]],
) -> None:
    # ranks 0 and 1 called generate twice, ranks 2 and 3 once: the second call of ranks 0 and 1
    # met the exit of ranks 2 and 3, and every rank got the same error, naming both
    where = "(ranks 0, 1: generate call 2; ranks 2, 3: leaving the block after 1 generate call)"
    for rank in range(4):
        run = runs[rank]["fsdp_uneven"]["uneven"]
        message = run["error"]
        assert "the ranks called generate or the model different numbers of times " + where in (
            message
        )
        assert f"on global rank {rank}:" in message
        assert "Call generate, and the model itself, the same number of times" in message
        assert "trains on unchanged" in message
        assert run["returned"] == 1  # the first call ran on every rank
        # ranks 0 and 1 were refused at their second call, ranks 2 and 3 on leaving
        assert run["body_done"] == (rank >= 2)
        # refused at once, not after the 2 s timeout (the message says which, too)
        assert "not every rank" not in message
        if rank < 2:  # a block that failed refuses further calls on its own
            assert "the model was called again after the block failed" in run["again"]
    _assert_trained_on(runs, "uneven")


@pytest.mark.multiprocess
def test_fsdp_generation_on_one_rank_is_refused_before_any_forward(
    runs: list[dict[str, Any]],
) -> None:
    # rank 0 (the rank monitored_barrier collects on) alone: its error names the others
    run = runs[0]["fsdp_uneven"]["alone"]
    assert run["returned"] == 0 and not run["body_done"], "rank 0 ran generate alone"
    message = run["error"]
    assert "not every rank entered the block within 2 s" in message
    assert "trainer.is_global_zero" in message and "on every rank" in message
    assert "Ranks 1, 2, 3 failed to pass monitoredBarrier" in message
    for rank in range(1, 4):
        assert "alone" not in runs[rank]["fsdp_uneven"]
    # rank 3 alone waits on rank 0, which the group's own timeout bounds (gloo's default:
    # 30 min); the generation_timeout there is 1 s, and 10 s leave room for a busy machine
    for rank in range(4):
        assert ("alone" in runs[rank]["fsdp_alone"]) == (rank == 3)
    run = runs[3]["fsdp_alone"]["alone"]
    assert run["returned"] == 0 and not run["body_done"]
    assert "not every rank entered the block within 1 s" in run["error"]
    assert "from rank 0" in run["error"]
    assert run["seconds"] < 10.0
    for case in ("uneven", "alone"):
        _assert_trained_on(runs, case)


@pytest.mark.multiprocess
def test_fsdp_rank_that_does_not_come_to_generate_is_refused_everywhere(
    runs: list[dict[str, Any]],
) -> None:
    # rank 3 slept past the 1.5 s timeout before its generate: the others gave up waiting at
    # their first call, and rank 3, arriving, found the group's connections closed
    for rank in range(4):
        run = runs[rank]["fsdp_late"]["late"]
        assert run["returned"] == 0 and not run["body_done"]
        assert (
            f"on global rank {rank} (generate call 1): not every rank came within 1.5 s"
            in (run["error"])
        )
        assert "this run cannot generate again" in run["error"]
        # ranks 0-2 after the timeout, rank 3 after its sleep; 10 s leave room
        assert run["seconds"] < 10.0
    # a later block of the run raises at once on every rank, instead of waiting
    for rank in range(4):
        run = runs[rank]["fsdp_uneven"]["after_timeout"]
        assert "not every rank entered the block within 2 s" in run["error"]
        assert "every later block of the run raises at once" in run["error"]
        assert run["seconds"] < 2.0
    _assert_trained_on(runs, "late")


@pytest.mark.multiprocess
def test_attention_left_switched_raises_at_the_next_step(runs: list[dict[str, Any]]) -> None:
    for rank in range(4):
        message = runs[rank]["forgotten"]
        assert message is not None, f"rank {rank} trained step 2 on the wrong attention"
        assert "runs the 'sdpa' attention inside a Skrull micro-batch" in message
        assert "set_attn_implementation('skrull')" in message
        assert "generating()" in message


# ----------------------------------------------------------------------------- a fault
GENERATION_FAULT = "injected fault in rank 1's generation, at its second token"
FORWARD_FAULT = "injected fault in rank 1's direct forward, in its first decoder layer"
FAULT_TIMEOUT = 120.0
"""``generation_timeout`` of the fault run: an exit meeting would hold rank 1 this long."""
FAULT_EXIT_BOUND_S = 60.0
"""Both processes end within this many seconds of the fault (the process group's timeout is
30 minutes, the generation timeout 2: only the error's propagation is fast)."""


class _RaiseAtSecondToken:
    """A logits processor that raises at the second generated token, after the call's first
    forward (the other rank is then inside the parameter all-gathers)."""

    def __init__(self, fault_file: str) -> None:
        self.calls = 0
        self.fault_file = fault_file

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 2:
            with open(self.fault_file, "w") as f:
                f.write(str(time.time()))
            raise RuntimeError(GENERATION_FAULT)
        return scores


class _RaiseInTheFirstLayer:
    """A forward pre-hook of the first decoder layer that raises: in the middle of the model's
    forward, after the root module's all-gather (the other rank then waits in the next one)."""

    def __init__(self, fault_file: str) -> None:
        self.fault_file = fault_file

    def __call__(self, module: Any, args: Any) -> None:
        with open(self.fault_file, "w") as f:
            f.write(str(time.time()))
        raise RuntimeError(FORWARD_FAULT)


class FailsMidCall(L.Callback):
    """After step 1 both ranks call the model (``generate``, or a direct forward); rank 1's call
    raises in the middle, and rank 1 catches the error (a direct forward's inside the block, a
    ``generate`` call's outside it) and trains on."""

    def __init__(self, kind: str, fault_file: str) -> None:
        self.kind = kind
        self.fault_file = fault_file

    def on_train_batch_end(
        self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        from transformers import LogitsProcessorList

        faulty = trainer.global_rank == 1
        prompt = torch.tensor([PROMPTS[0]])
        if self.kind == "forward":
            with trainer.strategy.generating() as model:
                if faulty:
                    model.model.layers[0].register_forward_pre_hook(
                        _RaiseInTheFirstLayer(self.fault_file)
                    )
                try:
                    model(prompt)
                except RuntimeError as err:
                    if not faulty:
                        raise
                    assert str(err) == FORWARD_FAULT
            return
        processors = LogitsProcessorList()
        if faulty:
            processors.append(_RaiseAtSecondToken(self.fault_file))
        try:
            with trainer.strategy.generating() as model:
                model.generate(
                    prompt, max_new_tokens=6, do_sample=False, pad_token_id=0,
                    logits_processor=processors,
                )  # fmt: skip
        except RuntimeError as err:
            if not faulty:
                raise
            assert str(err) == GENERATION_FAULT


def _fault_case(rank: int, world_size: int, kind: str, fault_file: str) -> str:
    from lightning_skrull import SkrullFSDPStrategy

    strategy = SkrullFSDPStrategy(cp_size=2, bucket_size=BUCKET)
    strategy.generation_timeout = FAULT_TIMEOUT
    _fit(strategy, (FailsMidCall(kind, fault_file),))
    return "the injected fault did not stop the run"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("kind", "fault"), [("generate", GENERATION_FAULT), ("forward", FORWARD_FAULT)]
)
def test_fsdp_call_failing_on_one_rank_ends_every_process_at_once(
    tmp_path: Any, kind: str, fault: str
) -> None:
    """A ``generate`` (or a forward called directly) that raises on rank 1 only, in the middle
    of the call (the other rank is in the parameter all-gathers, where no meeting reaches it),
    caught by rank 1: the block ends without its exit meeting, and rank 1 is refused what
    comes next (the direct forward caught inside the block: the block's exit; the ``generate``
    error caught outside it: the next collective, the ranks' agreement on
    ``trainer.should_stop`` after the step), naming the call (and the ``generate`` call's
    error), which ends its process; rank 0's all-gather fails with it, well within the
    generation timeout. Before, the caught forward held rank 1 at the exit meeting for the
    whole ``generation_timeout`` and then showed a timeout, and the caught ``generate`` left
    rank 1 to go on with collectives that did not pair with rank 0's."""
    from lightning_skrull.runtime.launch import DistributedRunError

    fault_file = tmp_path / "fault_time"
    with pytest.raises(DistributedRunError) as failed:
        spawn(_fault_case, 2, kind, str(fault_file), timeout=600)
    end = time.time()
    error = str(failed.value)
    call = "generate call 1" if kind == "generate" else "forward 1, called directly"
    refused = f"SkrullFSDPStrategy on global rank 1: inside generating(), {call}"
    assert f"rank 1 failed:\nRuntimeError: {refused}" in error, error
    if kind == "generate":  # the call's own error, in the refusal
        assert f"generate call 1 raised after its first forward (RuntimeError: {fault})" in error
    assert "rank 0 failed:" in error, error  # its peer stopped too, on the broken all-gather
    assert "not every rank came" not in error, error  # no exit meeting waited for a timeout
    assert end - float(fault_file.read_text()) < FAULT_EXIT_BOUND_S


# ----------------------------------------------------------------------------- one process
def _greedy(model: torch.nn.Module, ids: torch.Tensor) -> Any:
    return model.generate(
        ids,
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )


def test_left_padded_batch_equals_plain_transformers() -> None:
    """The chunked loss's forward wrapper is off inside the block: with it, ``generate`` would
    not see that the forward takes an attention mask and would attend to the padding."""
    model = prepare_model(tiny_qwen2(), backend="sdpa", chunked_loss=True)
    ids = torch.tensor([[0, 0, 5, 9, 2, 7], [3, 4, 5, 6, 7, 8]])  # row 0 left-padded
    ref = _greedy(reference_model().eval(), ids)
    with plain_attention(model) as hf_model:
        out = _greedy(hf_model, ids)
    assert torch.equal(out.sequences, ref.sequences)
    for logits, ref_logits in zip(out.logits, ref.logits):
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=LOGITS_ATOL)
    # what the block prevents: the wrapper left in place attends to the padding
    model.set_attn_implementation("sdpa")
    model.eval()
    wrong = _greedy(model, ids)
    assert max(float((a - b).abs().max()) for a, b in zip(wrong.logits, ref.logits)) > 0.1


def test_block_restores_everything_even_on_an_exception() -> None:
    module = PlainLM()
    model = prepare_model(module.model, backend="sdpa", chunked_loss=True)
    model.model.layers[0].eval()  # a submodule in eval stays so
    forward = vars(model)["forward"]
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    with pytest.raises(KeyError, match="in the block"), plain_attention(module) as hf_model:
        assert hf_model is model
        assert model.config._attn_implementation == "sdpa"
        assert not uses_chunked_loss(model)
        assert not any(m.training for m in model.modules())
        assert not torch.is_grad_enabled()
        for buffer in model.buffers():
            buffer.add_(1.0)
        raise KeyError("in the block")
    assert model.config._attn_implementation == ATTENTION_NAME
    assert vars(model)["forward"] is forward
    assert model.training and model.model.training and not model.model.layers[0].training
    assert model.model.layers[1].training
    assert torch.is_grad_enabled()
    for key, value in model.named_buffers():
        assert torch.equal(value, buffers[key])


def test_nested_blocks_restore_at_the_outer_exit() -> None:
    model = prepare_model(tiny_qwen2(), backend="sdpa", chunked_loss=True)
    with plain_attention(model):
        with plain_attention(model, attn_implementation="eager") as inner:
            assert inner.config._attn_implementation == "eager"
        assert model.config._attn_implementation == "sdpa"
        assert not uses_chunked_loss(model) and not model.training
    assert model.config._attn_implementation == ATTENTION_NAME
    assert uses_chunked_loss(model) and model.training


def test_the_attention_before_prepare_model_is_the_one_generated_with() -> None:
    model = prepare_model(tiny_model("qwen2"), backend="sdpa")  # built with eager attention
    with plain_attention(model) as hf_model:
        assert hf_model.config._attn_implementation == "eager"
    assert model.config._attn_implementation == ATTENTION_NAME


def test_a_model_that_was_never_prepared_is_only_put_in_eval() -> None:
    model = tiny_qwen2()
    ids = torch.tensor([[5, 9, 2, 7]])
    ref = _greedy(reference_model().eval(), ids)
    with plain_attention(model) as hf_model:
        assert hf_model.config._attn_implementation == "sdpa" and not hf_model.training
        out = _greedy(hf_model, ids)
    assert torch.equal(out.sequences, ref.sequences)
    assert model.config._attn_implementation == "sdpa" and model.training


def test_refused_inside_a_micro_batch_and_a_switched_model_refused_there() -> None:
    from lightning_skrull.data.collate import collate_rank
    from lightning_skrull.runtime.engine import micro_batch_context

    model = prepare_model(tiny_qwen2(), backend="sdpa")
    plan = one_rank_plan((0, 1), bucket_size=16)
    samples = make_samples([7, 5], seed=2)
    mb = collate_rank(samples, plan, dp_rank=0, cp_rank=0, world_size=1).micro_batches[0]
    with micro_batch_context(mb, None, "sdpa"):
        with (
            pytest.raises(RuntimeError, match="inside a Skrull micro-batch"),
            plain_attention(model),
        ):
            pass
        assert model.config._attn_implementation == ATTENTION_NAME
        model(**mb.inputs)  # the prepared model runs there
        model.set_attn_implementation("sdpa")
        with pytest.raises(RuntimeError, match="runs the 'sdpa' attention inside a Skrull"):
            model(**mb.inputs)
