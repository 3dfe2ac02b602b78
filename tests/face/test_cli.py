"""``skrull-finetune``: every shipped recipe parses, the defaults are ``tiny_cpu.yaml``, the
perplexity metric equals a one-process computation, and a short fit runs end to end."""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import yaml
from helpers import built_cli

from lightning_skrull import SkrullDataModule
from lightning_skrull.causal_lm import SkrullCausalLM, TokenPerplexity
from lightning_skrull.cli import TINY_CPU_TRAINER, TINY_QWEN2_5, SkrullCLI, main

CONFIGS = sorted((Path(__file__).parents[2] / "examples" / "configs").glob("*.yaml"))
TINY_CPU = Path(__file__).parents[2] / "examples" / "configs" / "tiny_cpu.yaml"


class _Parsed(Exception):
    """Raised with the parsed config instead of building the classes."""


class _ParseOnly(SkrullCLI):
    def before_instantiate_classes(self) -> None:
        raise _Parsed(self.config)


def parse(args: list[str]) -> Any:
    """The parsed configuration of ``skrull-finetune <args>`` (nothing is built or run)."""
    with pytest.raises(_Parsed) as parsed:
        _ParseOnly(
            SkrullCausalLM,
            SkrullDataModule,
            trainer_defaults=dict(TINY_CPU_TRAINER),
            seed_everything_default=0,
            save_config_callback=None,
            args=args,
        )
    return parsed.value.args[0]


def test_shipped_recipes_exist() -> None:
    names = {p.name for p in CONFIGS}
    assert {"tiny_cpu.yaml", "qwen2.5-0.5b.yaml", "qwen2.5-7b.yaml", "qwen2.5-32b.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_every_shipped_recipe_parses(path: Path, subcommand: str) -> None:
    config = getattr(parse([subcommand, "--config", str(path)]), subcommand)
    strategy = config.trainer.strategy
    assert strategy.class_path in (
        "lightning_skrull.SkrullStrategy",
        "lightning_skrull.SkrullZero2Strategy",
        "lightning_skrull.SkrullFSDPStrategy",
    )
    world = config.trainer.devices * config.trainer.num_nodes
    assert world % strategy.init_args.cp_size == 0  # CP groups tile the world
    assert strategy.init_args.bucket_size >= 1
    assert config.data.global_batch_size >= world // strategy.init_args.cp_size
    assert isinstance(config.model.model, (str, dict))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_recipe_states_its_validation_hold_out(path: Path) -> None:
    # The CLI's defaults are the tiny recipe's, val_split 32 among them: a recipe that left it
    # out would hold 32 of the user's samples out of training without showing it.
    data = yaml.safe_load(path.read_text())["data"]
    assert "val_split" in data or "val_data" in data, f"{path.name} inherits val_split"


def test_cli_defaults_are_the_tiny_cpu_recipe() -> None:
    defaults = parse(["fit"]).fit
    recipe = parse(["fit", "--config", str(TINY_CPU)]).fit
    assert defaults.model == recipe.model
    assert defaults.data == recipe.data
    assert recipe.model.model == TINY_QWEN2_5
    for key in TINY_CPU_TRAINER:
        if key != "strategy":
            assert defaults.trainer[key] == recipe.trainer[key], key
    assert defaults.trainer.strategy == recipe.trainer.strategy


def test_token_perplexity_equals_one_process() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, 20, 11)
    labels = torch.randint(0, 11, (3, 20))
    labels[0, :7] = -100
    labels[2, 12:] = -100
    token_losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    tokens = int((labels != -100).sum())
    metric = TokenPerplexity()
    with pytest.warns(UserWarning, match="before the ``update`` method"):
        assert math.isnan(float(metric.compute()))
    num_items = torch.tensor(tokens / 4.0)  # any normaliser: the update undoes it
    for mb_logits, mb_labels in zip(logits, labels, strict=True):
        loss = (
            torch.nn.functional.cross_entropy(
                mb_logits, mb_labels, ignore_index=-100, reduction="sum"
            )
            / num_items
        )
        metric.update(loss, num_items, (mb_labels != -100).sum())
    # float64 states: equal to the direct float32 computation to float32 rounding
    assert float(metric.compute()) == pytest.approx(
        math.exp(float(token_losses) / tokens), rel=1e-6
    )


def test_module_checks_its_arguments() -> None:
    with pytest.raises(TypeError, match="name or path"):
        SkrullCausalLM(model=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_type"):
        SkrullCausalLM(model={"hidden_size": 8})
    with pytest.raises(ValueError, match="learning_rate"):
        SkrullCausalLM(model=TINY_QWEN2_5, learning_rate=0)


def test_module_builds_the_tiny_qwen2_5() -> None:
    module = SkrullCausalLM(model=TINY_QWEN2_5, warmup_steps=3)
    assert type(module.model).__name__ == "Qwen2ForCausalLM"
    assert module.model.config.num_key_value_heads == 2
    config = module.configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"


class _LearningRates(L.Callback):
    """The learning rate each optimizer step ran with."""

    def __init__(self) -> None:
        self.lrs: list[float] = []

    def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
        self.lrs.append(float(optimizer.param_groups[0]["lr"]))


SCHEDULE_BATCHES, SCHEDULE_EPOCHS, SCHEDULE_WARMUP, SCHEDULE_LR = 3, 2, 2, 1e-3


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decaying_learning_rate_is_transformers_schedule_over_the_fit(
    world_of_one: None, schedule: str
) -> None:
    """``lr_schedule="linear"`` / ``"cosine"``: the learning rate of every optimizer step is
    transformers' own schedule over the fit's steps (the global batches of every epoch, what
    ``trainer.estimated_stepping_batches`` gives; checked at DP=2 x CP=2 in
    tests/strategies/test_lightning_habits.py)."""
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from lightning_skrull import SkrullStrategy

    recorder = _LearningRates()
    trainer = L.Trainer(
        strategy=SkrullStrategy(bucket_size=64), accelerator="cpu", devices=1,
        max_epochs=SCHEDULE_EPOCHS, callbacks=[recorder], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = SkrullCausalLM(
        model=TINY_QWEN2_5, learning_rate=SCHEDULE_LR, warmup_steps=SCHEDULE_WARMUP,
        lr_schedule=schedule,  # type: ignore[arg-type]
    )  # fmt: skip
    samples = [{"input_ids": list(range(1, 9 + k))} for k in range(2 * SCHEDULE_BATCHES)]
    trainer.fit(module, SkrullDataModule(train_data=samples, global_batch_size=2))
    steps = SCHEDULE_BATCHES * SCHEDULE_EPOCHS
    assert trainer.estimated_stepping_batches == steps == len(recorder.lrs)
    build = {"linear": get_linear_schedule_with_warmup, "cosine": get_cosine_schedule_with_warmup}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=SCHEDULE_LR)
    reference = build[schedule](optimizer, SCHEDULE_WARMUP, steps)
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        reference.step()
    assert recorder.lrs == pytest.approx(expected, rel=1e-12)
    assert recorder.lrs[0] == 0.0 and recorder.lrs[SCHEDULE_WARMUP] == SCHEDULE_LR  # warm-up
    assert recorder.lrs[-1] < recorder.lrs[SCHEDULE_WARMUP + 1] < SCHEDULE_LR  # decays


def test_decaying_learning_rate_needs_a_finite_fit(world_of_one: None) -> None:
    from lightning_skrull import SkrullStrategy

    with pytest.raises(ValueError, match="lr_schedule"):
        SkrullCausalLM(model=TINY_QWEN2_5, lr_schedule="step")  # type: ignore[arg-type]
    samples = [{"input_ids": list(range(1, 9))} for _ in range(4)]
    trainer = L.Trainer(
        strategy=SkrullStrategy(bucket_size=64), accelerator="cpu", devices=1, max_epochs=-1,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    module = SkrullCausalLM(model=TINY_QWEN2_5, warmup_steps=2, lr_schedule="cosine")
    with pytest.raises(ValueError, match=r"lr_schedule='cosine'.*no end \(max_epochs=-1"):
        trainer.fit(module, SkrullDataModule(train_data=samples, global_batch_size=2))


def test_short_fit_prints_speed_and_plan_statistics(
    world_of_one: None, capsys: pytest.CaptureFixture[str]
) -> None:
    main(
        [
            "fit",
            "--config",
            str(TINY_CPU),
            "--trainer.devices=1",
            "--trainer.strategy.init_args.cp_size=1",
            "--trainer.strategy.init_args.bucket_size=2048",
            "--trainer.max_steps=2",
            "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--data.global_batch_size=8",
            "--data.val_split=8",
        ]
    )
    out = capsys.readouterr().out
    assert "Skrull run summary (DP=1 x CP=1, 2 steps, policy skrull)" in out
    speed = next(line for line in out.splitlines() if "tokens/s" in line)
    assert float(speed.split()[-1]) > 0


def test_a_calibrated_cost_model_pins_in_yaml(tmp_path: Path) -> None:
    # what docs/calibration.md tells a user to do: dump strategy.cost_model after a run as the
    # strategy's cost_model in the next run's YAML; the strategy built from it has that model
    import dataclasses

    import yaml

    from lightning_skrull.scheduling import CostModel

    calibrated = CostModel().with_constants(
        achieved_flops=3.1e14,
        micro_batch_overhead_s=0.04,
        per_sequence_seconds=1e-4,
        comm_latency_s=3e-4,
        comm_bandwidth=1.2e10,
    )
    strategy = {
        "class_path": "lightning_skrull.SkrullStrategy",
        "init_args": {"calibration": "off", "cost_model": dataclasses.asdict(calibrated)},
    }
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"strategy": strategy}}))
    cli = built_cli("--config", str(path))
    assert cli.trainer.strategy.skrull_config.cost_model == calibrated
    assert cli.trainer.strategy.skrull_config.calibration == "off"


def test_named_validation_sets_from_a_recipe(tmp_path: Path) -> None:
    import yaml

    sets = {"short": "bundled:mixed_tiny", "long": "bundled:mixed_tiny"}
    path = tmp_path / "sets.yaml"
    data = {"val_data": sets, "val_split": 0}
    path.write_text(yaml.safe_dump({"data": data}, sort_keys=False))  # in the order written
    cli = built_cli("--config", str(path))
    # the recipe's order is the loaders' order; the module names its perplexities after them
    assert cli.datamodule.val_set_names == ("short", "long")
    assert "dataloader_idx" in inspect.signature(cli.model.validation_step).parameters


def test_weight_decay_spares_biases_and_norms_as_transformers_trainer_does() -> None:
    """AdamW's parameter groups are transformers' ``Trainer``'s: weight decay on the names its
    ``get_decay_parameter_names`` gives, none on biases and RMSNorm weights. With
    ``decay_norms_and_biases`` (and for a checkpoint's hyperparameters written before the
    argument existed, which resume with their one group) every weight decays."""
    from transformers import Trainer

    module = SkrullCausalLM(model=TINY_QWEN2_5, weight_decay=0.1)
    optimizer = module.configure_optimizers()
    names = {id(p): n.removeprefix("model.") for n, p in module.named_parameters()}
    decayed, spared = optimizer.param_groups
    own = {n for n, _ in module.model.named_parameters()}
    assert {names[id(p)] for p in decayed["params"]} == set(
        Trainer.get_decay_parameter_names(None, module.model)  # type: ignore[arg-type]
    ) & own
    spared_names = {names[id(p)] for p in spared["params"]}
    assert "model.layers.0.self_attn.q_proj.bias" in spared_names
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= spared_names
    assert (decayed["weight_decay"], spared["weight_decay"]) == (0.1, 0.0)
    assert len(decayed["params"]) + len(spared["params"]) == len(own)
    every = SkrullCausalLM(model=TINY_QWEN2_5, weight_decay=0.1, decay_norms_and_biases=True)
    older = SkrullCausalLM(model=TINY_QWEN2_5, weight_decay=0.1)
    del older.hparams["decay_norms_and_biases"]
    for module in (every, older):
        (group,) = module.configure_optimizers().param_groups
        assert group["weight_decay"] == 0.1 and len(group["params"]) == len(own)
