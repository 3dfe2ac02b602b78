"""What a fit starts from when the model comes from ``from_pretrained``: training mode, and
float32 master weights where the precision has them.

The DP=2 x CP=2 runs of both are in tests/strategies/test_precision_matrix.py (a bf16 checkpoint with
activation checkpointing under ``"bf16-mixed"``, against plain HF) and tests/strategies/test_fsdp.py
(``SkrullFSDPStrategy(activation_checkpointing=True)`` on a model read with
``from_pretrained``); here, the rules on one process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import UNFREEZE_AT, PlainLM, UnfreezingLM, cpu_trainer, make_data, tiny_qwen2
from lightning.pytorch.plugins.precision import MixedPrecision

from lightning_skrull.models.modes import cast_trainable_parameters, train_mode_for_fit
from lightning_skrull.strategies.ddp import HALF_DTYPES


def test_a_model_wholly_in_eval_mode_is_put_in_training_mode() -> None:
    model = tiny_qwen2().eval()  # as from_pretrained returns it
    assert train_mode_for_fit(model)
    assert all(m.training for m in model.modules())
    assert not train_mode_for_fit(model)  # already training: nothing to do


def test_mixed_modes_are_left_as_set() -> None:
    model = tiny_qwen2()
    model.model.embed_tokens.eval()  # set on purpose
    assert not train_mode_for_fit(model)
    assert not model.model.embed_tokens.training
    assert model.model.layers[0].training


def test_checkpointed_layers_left_in_eval_mode_are_refused() -> None:
    model = tiny_qwen2()
    model.gradient_checkpointing_enable()
    model.model.layers[1].eval()  # its checkpointing would silently not run
    with pytest.raises(ValueError, match=r"1 module\(s\) of Qwen2ForCausalLM.*model\.layers\.1"):
        train_mode_for_fit(model)
    with pytest.raises(ValueError, match=r"Call \.train\(\) on the model before fitting"):
        train_mode_for_fit(model)


def test_cast_keeps_frozen_parameters_and_the_parameter_objects() -> None:
    model = tiny_qwen2().to(torch.bfloat16)
    model.model.embed_tokens.weight.requires_grad_(False)
    head = model.lm_head.weight
    loaded = head.detach().clone()
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert cast_trainable_parameters(model, torch.float32, from_dtypes=HALF_DTYPES) == trainable
    assert model.lm_head.weight is head  # an optimizer built on it keeps it
    assert head.dtype == torch.float32
    assert torch.equal(head.detach(), loaded.float())  # lossless
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert cast_trainable_parameters(model, torch.float32, from_dtypes=HALF_DTYPES) == 0


def test_cast_of_every_floating_dtype_or_of_the_half_ones() -> None:
    """SkrullStrategy casts bf16 / fp16 only (a float64 parameter stays); SkrullFSDPStrategy
    casts every trainable floating dtype to its master dtype, bf16 under "bf16-true" too."""
    model = tiny_qwen2()
    model.lm_head.to(torch.float64)
    model.model.embed_tokens.weight.requires_grad_(False)
    assert cast_trainable_parameters(model, torch.float32, from_dtypes=HALF_DTYPES) == 0
    assert model.lm_head.weight.dtype == torch.float64
    assert cast_trainable_parameters(model, torch.float32) == 1
    assert model.lm_head.weight.dtype == torch.float32
    trainable = sum(1 for p in model.parameters() if p.requires_grad)
    assert cast_trainable_parameters(model, torch.bfloat16) == trainable
    assert model.model.embed_tokens.weight.dtype == torch.float32  # frozen: as loaded


@pytest.mark.parametrize(
    ("precision", "trained_dtype"),
    [
        ("32-true", torch.float32),
        ("bf16-mixed", torch.float32),
        ("16-mixed", torch.float32),
        ("bf16-true", torch.bfloat16),
    ],
)
def test_skrull_strategy_gives_float32_master_weights_where_the_precision_has_them(
    world_of_one: None, precision: str, trained_dtype: torch.dtype
) -> None:
    """A model loaded in bf16 with a frozen embedding: the trainable weights train in the
    precision's master dtype, the frozen one stays as loaded, and every module trains in
    training mode although the model arrived in eval mode."""
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    module = PlainLM()
    module.model.to(torch.bfloat16).eval()
    module.model.model.embed_tokens.weight.requires_grad_(False)
    modes: list[bool] = []
    module.on_train_start = lambda: modes.extend(m.training for m in module.model.modules())  # type: ignore[method-assign]
    kwargs: dict[str, Any] = {"precision": precision}
    if precision == "16-mixed":  # fp16 on CPU needs the plugin (the Trainer flag runs bf16)
        scaler = torch.amp.GradScaler("cpu")
        kwargs = {"plugins": [MixedPrecision("16-mixed", device="cpu", scaler=scaler)]}
    trainer = cpu_trainer(SkrullStrategy(bucket_size=80), max_steps=1, **kwargs)
    data = SkrullDataModule(train_data=make_data(4), global_batch_size=4, shuffle=False)
    trainer.fit(module, data)
    assert trainer.global_step == 1
    assert modes and all(modes)
    assert module.model.lm_head.weight.dtype == trained_dtype
    assert module.model.model.layers[0].mlp.up_proj.weight.dtype == trained_dtype
    assert module.model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_resumed_fit_loads_the_float32_master_weights_into_float32(
    world_of_one: None, tmp_path: Path
) -> None:
    """A fit of a model loaded in bf16, resumed from its checkpoint with the model loaded in
    bf16 again (what a resumed script does): the checkpoint's float32 master weights are the
    resumed fit's weights exactly, and the resumed fit ends where the uninterrupted one did.
    Lightning restores a DDP strategy's checkpoint before the strategy's setup casts the
    weights to float32; copied into the bf16 parameters first, they were rounded to bf16
    (measured 1.6e-3 to 3.8e-3 off at DP=2 x CP=2, tests/strategies/test_weight_averaging.py). In
    ``"bf16-mixed"``; ``"32-true"`` and ``"16-mixed"`` cast the same way, in the same call."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_skrull import SkrullDataModule, SkrullStrategy

    def fit(ckpt_path: str | None = None) -> tuple[PlainLM, dict[str, torch.Tensor]]:
        module = PlainLM()
        module.model.to(torch.bfloat16)
        started: dict[str, torch.Tensor] = {}
        module.on_train_start = lambda: started.update(  # type: ignore[method-assign]
            {k: v.detach().clone() for k, v in module.state_dict().items()}
        )
        save = ModelCheckpoint(
            dirpath=tmp_path, filename="{step}", every_n_train_steps=1, save_top_k=-1
        )
        trainer = cpu_trainer(
            SkrullStrategy(bucket_size=80),
            max_steps=2,
            precision="bf16-mixed",
            callbacks=[save],
            enable_checkpointing=True,
        )
        data = SkrullDataModule(train_data=make_data(8), global_batch_size=4, shuffle=False)
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return module, started

    whole, _ = fit()
    checkpoint = str(tmp_path / "step=1.ckpt")
    saved = torch.load(checkpoint, weights_only=False)["state_dict"]
    resumed, started = fit(checkpoint)
    # the resumed fit started from the checkpoint's float32 weights, bit for bit
    assert started.keys() == saved.keys()
    for key, value in saved.items():
        assert started[key].dtype == value.dtype == torch.float32, key
        assert torch.equal(started[key], value), key
    # and ended where the uninterrupted fit did: one process, the same batches and plans, so
    # the same arithmetic (measured 0.0)
    final = dict(resumed.state_dict())
    for key, value in whole.state_dict().items():
        assert torch.equal(final[key], value), key


def test_a_bf16_parameter_unfrozen_mid_fit_gets_float32_master_weights(world_of_one: None) -> None:
    """A model loaded in bf16 whose embeddings, frozen at setup (and so left in bf16), are
    unfrozen in a hook during a ``"bf16-mixed"`` fit: ``SkrullStrategy`` casts them to float32
    before the step, as it casts the trainable weights at setup, so they train in float32 from
    the loaded bf16 values (cast losslessly)."""
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    module = UnfreezingLM(torch.bfloat16)
    embed = module.model.model.embed_tokens.weight
    loaded = embed.detach().clone()
    seen: list[tuple[torch.dtype, bool]] = []
    module.on_train_batch_end = lambda *_: seen.append(  # type: ignore[method-assign]
        (embed.dtype, torch.equal(embed.detach().float(), loaded.float()))
    )
    trainer = cpu_trainer(
        SkrullStrategy(bucket_size=80), max_steps=UNFREEZE_AT + 1, precision="bf16-mixed"
    )
    data = SkrullDataModule(train_data=make_data(8), global_batch_size=4, shuffle=False)
    trainer.fit(module, data)
    assert module.model.model.embed_tokens.weight is embed  # the optimizer's parameter
    # frozen in bf16 until step UNFREEZE_AT, trained in float32 from it
    assert seen == [(torch.bfloat16, True)] * UNFREEZE_AT + [(torch.float32, False)]


def test_embeddings_frozen_mid_fit_under_reentrant_checkpointing_are_refused(
    world_of_one: None,
) -> None:
    """Reentrant activation checkpointing without transformers' input-gradient hook passes the
    setup's check while the input embeddings train; frozen in a hook later, they would leave
    every checkpointed layer without a gradient, silently. The check runs again when the
    trainable parameters change, before the step."""
    from lightning_skrull import SkrullDataModule, SkrullStrategy

    class FreezingLM(PlainLM):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if self.global_step == UNFREEZE_AT:
                self.model.model.embed_tokens.weight.requires_grad_(False)

    module = FreezingLM()
    module.model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": True}
    )
    module.model.disable_input_require_grads()
    trainer = cpu_trainer(SkrullStrategy(bucket_size=80), max_steps=UNFREEZE_AT + 1)
    data = SkrullDataModule(train_data=make_data(8), global_batch_size=4, shuffle=False)
    with pytest.raises(ValueError, match=r"reentrant activation checkpointing.*no gradient"):
        trainer.fit(module, data)
    assert trainer.global_step == UNFREEZE_AT
