"""A compiled model under the Skrull strategies.

One spawn of 4 gloo processes (DP=2 x CP=2) trains the tiny Qwen2 compiled with
``dynamic=True`` for 2 SGD steps under ``SkrullStrategy`` (:data:`RUNS`): with inductor
``torch.compile(model)`` in ``__init__`` in ``32-true``, and with ``aot_eager`` each decoder
layer compiled in place (``layer.compile()``, the graph then breaking at the attention inside
each layer's compiled forward) in ``bf16-mixed``. Each run costs tens of seconds per process on
a CPU runner, most of it dynamo's tracing and inductor's code generation.
``trainer.fit(torch.compile(module))`` (Lightning's path: Lightning unwraps the module and
compiles its step methods) is trained on one process in ``bf16-mixed``: it traces the same
model as ``torch.compile(model)`` with one frame more, the ``training_step``, at a quarter of the
CPU time of four processes. ``model.compile()`` (in place) traces what ``torch.compile(model)``
traces, in another wrapper; that it is seen and refused where it cannot train is checked on one
process. The data is built so that in both steps DP rank 0 runs two micro-batches (one 60-token
sequence sharded over the CP ranks each) and DP rank 1 one micro-batch holding a sharded
60-token sequence and two 2-token sequences whole on one CP rank each (asserted). Each run is
compared with plain Hugging Face training on one process (``bf16-mixed`` by docs/precision.md's
16-bit rule), and the graphs dynamo compiled in every step are counted.

Without the Skrull attention excluded from compilation the same run trained silently wrong
(dynamo traced the K/V exchange's autograd nodes, which share state through a Python object
and run asynchronous collectives: parameters off by 2.2e-2 after 2 steps); these tests catch it.
"""

from __future__ import annotations

import functools
import os
import re
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from helpers import (
    cpu_trainer,
    global_batches,
    prompted_samples,
    reference_model,
    sgd_steps,
    tiny_qwen2,
)
from precision_rule import FLOOR, RATIO, relative_distance, update

from lightning_skrull.runtime.launch import spawn
from lightning_skrull.strategies.setup_checks import compiled_forms

LENGTHS = ((60, 60, 60, 2, 2), (58, 58, 58, 3, 3))
"""The global batch of each step: at CP=2 with a 32-token bucket DP rank 0 runs two
micro-batches (a sharded long sequence each), DP rank 1 one (a sharded long sequence and the two
short ones whole on one CP rank each). Step 2's lengths differ, so each rank's micro-batches have
new shapes and a new layout."""
CP, BUCKET, STEPS, LR = 2, 32, 2, 0.5
RUNS = (
    ("torch.compile(model)", "32-true", "inductor"),
    ("decoder layers", "bf16-mixed", "aot_eager"),
)
"""``(form, precision, backend)`` of each run of the spawn. Inductor compiles the first: its
code generation runs on the graphs dynamo cuts around the Skrull attention. The compiled
decoder layers differ in how dynamo wraps and cuts the model (per layer), not in what inductor
generates, and ``bf16-mixed`` adds autocast's casts to the graphs: they are traced by dynamo
and run through AOTAutograd without inductor's code generation (``aot_eager``), which is where
the wrong result this file guards against arose (dynamo's tracing; the eager backend reproduced
it), and held to the 16-bit rule, which the traced attention's error (2.2e-2) fails. Measured
on the 2-core CI machine, four processes at once: the inductor run 77 s (cold cache), the
``aot_eager`` one 19 s; Lightning's path, which ran here too, took 38-49 s and now runs on one
process (:func:`test_lightning_path_on_one_process`)."""
SEEN = {"decoder layers": ["model.model.layers.0.compile()", "model.model.layers.1.compile()"]}
"""What :func:`compiled_forms` names for a form, where that is not the form itself."""
# float32: the packed, sharded computation sums the same terms in another order than the
# reference and DDP averages over 4 ranks; parameters agree to a few ulps (measured 6e-8 for
# each form, as eager). The wrong result this guards against was off by 2.2e-2.
PARAM_ATOL = 1e-5


def make_data() -> list[dict[str, list[int]]]:
    """The global batches of :data:`LENGTHS`; the long samples start with a 5-token
    unsupervised prompt."""
    return prompted_samples([length for lengths in LENGTHS for length in lengths], seed=0)


class CompiledLM(L.LightningModule):
    """The documentation's module with its model compiled in ``__init__`` (or not), recording
    per step the micro-batches it ran, their layouts and what dynamo compiled."""

    def __init__(self, form: str, backend: str = "inductor") -> None:
        super().__init__()
        model = tiny_qwen2()
        if form == "torch.compile(model)":
            model = torch.compile(model, dynamic=True, backend=backend)  # type: ignore[assignment]
        elif form == "model.compile()":
            model.compile(dynamic=True, backend=backend)
        elif form == "decoder layers":
            for layer in model.model.layers:
                layer.compile(dynamic=True, backend=backend)
        self.model = model
        self.steps: list[dict[str, Any]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model(**batch).loss  # type: ignore[no-any-return]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        from torch._dynamo.utils import counters

        layouts = [mb.layout for mb in batch.rank_batch.micro_batches]
        self.steps.append(
            {
                "micro_batches": len(layouts),
                "mixed": [
                    bool(lay.distributed_sequence_ids and lay.local_sequence_ids) for lay in layouts
                ],
                "frames": counters["frames"]["total"],
                "graphs": counters["stats"]["unique_graphs"],
                "graph_breaks": sum(counters["graph_break"].values()),
            }
        )

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR)


def _fit(
    form: str, precision: str, backend: str, cp: int = CP, bucket: int = BUCKET
) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    from lightning_skrull import SkrullDataModule, SkrullStrategy

    torch._dynamo.reset()  # each run's compiles counted alone (inductor's graph cache stays)
    counters.clear()
    module = CompiledLM(form, backend)
    trainer = cpu_trainer(
        SkrullStrategy(cp_size=cp, bucket_size=bucket), max_steps=STEPS, precision=precision
    )
    data = SkrullDataModule(
        train_data=make_data(), global_batch_size=len(LENGTHS[0]), shuffle=False
    )
    hf = module.model._orig_mod if form == "torch.compile(model)" else module.model
    before = {k: v.detach().double().numpy().copy() for k, v in hf.state_dict().items()}
    fitted: Any = module
    if form == "torch.compile(module)":
        fitted = torch.compile(module, dynamic=True, backend=backend)
    trainer.fit(fitted, data)  # type: ignore[arg-type]
    return {
        "forms": compiled_forms(module),
        "before": before,
        "steps": module.steps,
        "params": {k: v.detach().double().numpy().copy() for k, v in hf.state_dict().items()},
    }


def _compiled_cases(rank: int, world_size: int, cache_dir: str) -> dict[str, Any]:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # cold: what a first CI run pays
    return {
        f"{form} {precision}": _fit(form, precision, backend) for form, precision, backend in RUNS
    }


@functools.cache
def reference(autocast: bool = False) -> dict[str, np.ndarray]:
    """Plain HF training of the same global batches on one process: one sequence at a time,
    summed token loss over the global batch's supervised tokens, SGD; the forward under
    ``torch.autocast("cpu", bfloat16)`` with ``autocast`` (the reference of the 16-bit rule,
    docs/precision.md, that a ``bf16-mixed`` run is held to)."""
    data = make_data()
    model = reference_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    size = len(LENGTHS[0])
    for _ in sgd_steps(model, optimizer, global_batches(data, STEPS, size), autocast=autocast):
        pass
    return {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    cache_dir = str(tmp_path_factory.mktemp("inductor_cache"))
    return spawn(_compiled_cases, 4, cache_dir, timeout=900)


def test_layouts_differ_between_dp_ranks_and_mix_sharded_and_local(
    ranks: list[dict[str, Any]],
) -> None:
    for run in ranks[0]:
        counts = [[s["micro_batches"] for s in r[run]["steps"]] for r in ranks]
        assert counts == [[2, 2], [2, 2], [1, 1], [1, 1]], (run, counts)
        mixed = [[s["mixed"] for s in r[run]["steps"]] for r in ranks]
        # DP rank 1's one micro-batch holds a sharded sequence and a local one on each CP rank
        assert all(m == [[True], [True]] for m in mixed[2:]), (run, mixed)
        assert all(m == [[False, False]] * 2 for m in mixed[:2]), (run, mixed)


def test_each_form_is_seen_compiled(ranks: list[dict[str, Any]]) -> None:
    for form, precision, _ in RUNS:
        assert ranks[0][f"{form} {precision}"]["forms"] == SEEN.get(form, [form])


@pytest.mark.parametrize("form", [form for form, precision, _ in RUNS if precision == "32-true"])
def test_float32_equals_single_process(ranks: list[dict[str, Any]], form: str) -> None:
    ref = reference(autocast=False)
    for r in ranks:
        params = r[f"{form} 32-true"]["params"]
        assert params.keys() == ref.keys()
        worst = max(float(np.abs(params[k] - ref[k]).max()) for k in ref)
        assert worst < PARAM_ATOL, (form, worst)


def _bf16_rule(run: dict[str, Any]) -> tuple[float, float]:
    """docs/precision.md's 16-bit rule for a ``bf16-mixed`` run: the update's distance to the
    float32 reference's update at most RATIO x single-process autocast training's plus FLOOR,
    and farther than FLOOR (a compiled graph that dropped autocast would lie 3e-7 away, as the
    ``32-true`` runs do); the update scaled by 1.05 fails it. Returns (d(run), d(ref))."""
    before = {k: v.detach().double().numpy() for k, v in reference_model().state_dict().items()}
    assert all(run["before"][k].tobytes() == v.tobytes() for k, v in before.items())
    delta_fp32 = update(before, reference(autocast=False))
    ref_distance = relative_distance(update(before, reference(autocast=True)), delta_fp32)
    assert ref_distance > FLOOR
    bound = RATIO * ref_distance + FLOOR
    delta = update(before, run["params"])
    distance = relative_distance(delta, delta_fp32)
    assert FLOOR < distance <= bound, (distance, ref_distance)
    assert relative_distance(1.05 * delta, delta_fp32) > bound
    return distance, ref_distance


def test_bf16_mixed_as_close_to_float32_as_single_process(ranks: list[dict[str, Any]]) -> None:
    """The compiled decoder layers in ``bf16-mixed`` at DP=2 x CP=2, by the 16-bit rule:
    measured 3.5e-3 against the reference's 4.0e-3, bound 9.1e-3 (with inductor, each measured
    once: ``torch.compile(model)`` 3.4e-3, ``model.compile()`` 3.5e-3)."""
    for r in ranks:
        run = r["decoder layers bf16-mixed"]
        assert run["forms"] == SEEN["decoder layers"]
        _bf16_rule(run)


def _second_step_compiles_nothing(run: str, steps: list[dict[str, Any]]) -> None:
    first, second = steps
    assert first["graphs"] > 0 and first["graph_breaks"] > 0, (run, first)
    assert (second["frames"], second["graphs"]) == (first["frames"], first["graphs"]), (run, steps)


def test_the_second_step_compiles_nothing_new(ranks: list[dict[str, Any]]) -> None:
    """Graphs are compiled in the first step only, with a graph break at each layer's
    attention: the second step's new shapes and layouts reuse them (the attention and the
    chunked loss, which would specialise on a layout or a length, run eagerly)."""
    for r in ranks:
        for run, out in r.items():
            _second_step_compiles_nothing(run, out["steps"])


def test_lightning_path_on_one_process(world_of_one: None) -> None:
    """``trainer.fit(torch.compile(module))`` in ``bf16-mixed`` (``aot_eager``) on one process
    (CP=1, a 64-token bucket: three micro-batches per step, the long sequences whole): the
    16-bit rule against the same reference as the spawn, measured 3.4e-3 (bound 9.1e-3; at
    DP=2 x CP=2, measured once each: 3.5e-3 with ``aot_eager``, 3.4e-3 with inductor), and step
    2 of new lengths compiles nothing."""
    run = _fit("torch.compile(module)", "bf16-mixed", "aot_eager", cp=1, bucket=64)
    assert run["forms"] == ["torch.compile(module)"]
    assert [s["micro_batches"] for s in run["steps"]] == [3, 3]
    _second_step_compiles_nothing("torch.compile(module)", run["steps"])
    _bf16_rule(run)


# ----------------------------------------------------------------------------- one process
def _fit_one_step(strategy: Any, module: Any) -> None:
    from lightning_skrull import SkrullDataModule

    trainer = cpu_trainer(strategy, max_steps=1)
    data = SkrullDataModule(train_data=make_data(), global_batch_size=len(LENGTHS[0]))
    trainer.fit(module, data)


def _compiled_module(form: str) -> Any:
    if form == "decoder layers":
        module = CompiledLM("none")
        for layer in module.model.model.layers:
            layer.compile(dynamic=True)
        return module
    if form == "torch.compile(module)":
        return torch.compile(CompiledLM("none"), dynamic=True)
    return CompiledLM(form)


def test_compiled_forms_names_each_compiled_piece() -> None:
    assert compiled_forms(CompiledLM("none")) == []
    assert compiled_forms(CompiledLM("torch.compile(model)")) == ["torch.compile(model)"]
    assert compiled_forms(CompiledLM("model.compile()")) == ["model.compile()"]
    assert compiled_forms(_compiled_module("decoder layers")) == [
        "model.model.layers.0.compile()",
        "model.model.layers.1.compile()",
    ]


@pytest.mark.parametrize("form", ["torch.compile(model)", "model.compile()", "decoder layers"])
@pytest.mark.parametrize("name", ["SkrullFSDPStrategy", "SkrullZero2Strategy"])
def test_sharding_strategies_refuse_a_compiled_model_at_setup(
    world_of_one: None, name: str, form: str
) -> None:
    import lightning_skrull

    strategy = getattr(lightning_skrull, name)(bucket_size=80)
    shown = "model.model.layers.0.compile()" if form == "decoder layers" else form
    with pytest.raises(
        ValueError,
        match=rf"{re.escape(shown)}.*not supported under {name}: .*Train the model uncompiled",
    ):
        _fit_one_step(strategy, _compiled_module(form))


@pytest.mark.parametrize("name", ["SkrullFSDPStrategy", "SkrullZero2Strategy"])
def test_lightning_refuses_a_compiled_module_under_the_sharding_strategies(
    world_of_one: None, name: str
) -> None:
    import lightning_skrull

    strategy = getattr(lightning_skrull, name)(bucket_size=80)
    with pytest.raises(RuntimeError, match=rf"compiled model is incompatible .*{name}"):
        _fit_one_step(strategy, _compiled_module("torch.compile(module)"))
