"""Reading a pretrained model on rank 0 only (``from_pretrained_on_rank_zero``), in one process:
the rank-from-environment rule, the meta build on the other ranks, the CLI's choice, and the
refusal of the replicating strategies (the sharded case runs in tests/strategies/test_fsdp.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from helpers import (
    BUCKET,
    GLOBAL_BATCH,
    PlainLM,
    built_cli,
    cpu_trainer,
    make_data,
    save_mxfp4_gpt_oss,
    tiny_qwen2,
)

from lightning_skrull import (
    SkrullDataModule,
    SkrullFSDPStrategy,
    SkrullStrategy,
    SkrullZero2Strategy,
)
from lightning_skrull.causal_lm import SkrullCausalLM
from lightning_skrull.cli import is_fsdp_strategy
from lightning_skrull.models import (
    from_pretrained_on_rank_zero,
    launched_as_rank_zero,
    loads_weights_here,
)

RANK_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID")


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A tiny Qwen2 written with ``save_pretrained``."""
    tiny_qwen2().save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny"


@pytest.fixture
def as_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set the launcher environment of one process of a 4-process job (``as_rank(1)``)."""
    for key in RANK_ENV:
        monkeypatch.delenv(key, raising=False)

    def set_rank(rank: int) -> None:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")

    return set_rank


# ----------------------------------------------------------------------------- the rule
@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, None),  # a script before Lightning launched its processes, a notebook
        ({"WORLD_SIZE": "1", "RANK": "3"}, True),  # one process is rank 0
        ({"RANK": "0", "WORLD_SIZE": "8"}, True),  # torchrun
        ({"RANK": "5", "LOCAL_RANK": "0", "NODE_RANK": "0"}, False),  # RANK wins
        ({"LOCAL_RANK": "0", "NODE_RANK": "0", "WORLD_SIZE": "8"}, True),  # Lightning's children
        ({"LOCAL_RANK": "2", "NODE_RANK": "0", "WORLD_SIZE": "8"}, False),
        ({"LOCAL_RANK": "0", "NODE_RANK": "1", "WORLD_SIZE": "8"}, False),
        ({"NODE_RANK": "1"}, False),  # the launching process of the second node
        ({"NODE_RANK": "0"}, None),  # the launching process of the first node, not yet known
        ({"LOCAL_RANK": "0"}, None),  # which node is not known
        ({"LOCAL_RANK": "3"}, False),
        ({"LOCAL_RANK": "0", "GROUP_RANK": "2"}, False),  # torchelastic's node rank
        ({"SLURM_PROCID": "0"}, True),
        ({"SLURM_PROCID": "7"}, False),
        ({"LOCAL_RANK": "0", "SLURM_PROCID": "4"}, False),
        ({"JSM_NAMESPACE_RANK": "0"}, True),
        ({"RANK": ""}, None),  # an empty variable is not a rank
    ],
)
def test_rank_zero_from_the_environment(environ: dict[str, str], expected: bool | None) -> None:
    assert launched_as_rank_zero(environ) is expected
    # unknown loads in full: memory, never correctness
    assert loads_weights_here(environ) is (expected is not False)


def test_a_process_group_knows_its_rank_better_than_the_environment() -> None:
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        assert loads_weights_here({"RANK": "3", "WORLD_SIZE": "4"})
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the loader
def test_other_ranks_build_the_same_model_on_meta(saved: Path, as_rank: Any) -> None:
    as_rank(0)
    loaded = from_pretrained_on_rank_zero(saved, dtype=torch.bfloat16)
    as_rank(2)
    meta = from_pretrained_on_rank_zero(saved, dtype=torch.bfloat16)
    assert not any(t.is_meta for t in loaded.state_dict().values())
    assert all(p.is_meta for p in meta.parameters())
    assert all(b.is_meta for b in meta.buffers())
    assert type(meta) is type(loaded)
    assert not meta.training and not loaded.training  # from_pretrained returns eval mode
    shapes = {k: (v.shape, v.dtype) for k, v in loaded.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == shapes
    assert dict(loaded.named_buffers()).keys() == dict(meta.named_buffers()).keys()
    assert meta.config.to_dict() == loaded.config.to_dict()
    # rank 0 got the saved weights (in the requested dtype)
    reference = tiny_qwen2().to(torch.bfloat16).state_dict()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.items())


def test_config_overrides_reach_every_rank(saved: Path, as_rank: Any) -> None:
    as_rank(1)
    meta = from_pretrained_on_rank_zero(saved, use_cache=False, attn_implementation="eager")
    assert meta.config.use_cache is False
    assert meta.config._attn_implementation == "eager"


def test_an_unknown_rank_loads_in_full(saved: Path, as_rank: Any) -> None:
    model = from_pretrained_on_rank_zero(saved)  # as_rank cleared the launcher variables
    assert not any(p.is_meta for p in model.parameters())


@pytest.mark.parametrize("rank", [0, 1])
def test_loading_only_arguments_are_refused_on_every_rank(
    saved: Path, as_rank: Any, rank: int
) -> None:
    as_rank(rank)
    with pytest.raises(ValueError, match=r"cannot follow \['device_map'\].*on every rank"):
        from_pretrained_on_rank_zero(saved, device_map="cpu")


# ----------------------------------------------------------------------------- the CLI
def test_cli_module_loads_on_rank_zero_only_when_asked(saved: Path, as_rank: Any) -> None:
    as_rank(3)
    module = SkrullCausalLM(model=str(saved), load_on_rank_zero=True)
    assert all(p.is_meta for p in module.model.parameters())
    for choice in (None, False):  # outside the CLI, None loads on every rank
        module = SkrullCausalLM(model=str(saved), load_on_rank_zero=choice)
        assert not any(p.is_meta for p in module.model.parameters())


def test_is_fsdp_strategy() -> None:
    assert is_fsdp_strategy("skrull_fsdp")
    assert is_fsdp_strategy("skrull_fsdp_world")
    assert is_fsdp_strategy({"class_path": "lightning_skrull.SkrullFSDPStrategy"})
    assert is_fsdp_strategy(SkrullFSDPStrategy)
    assert is_fsdp_strategy(SkrullFSDPStrategy(cp_size=1))
    assert not is_fsdp_strategy("skrull")
    assert not is_fsdp_strategy("ddp")
    assert not is_fsdp_strategy("unregistered")
    assert not is_fsdp_strategy({"class_path": "lightning_skrull.SkrullStrategy"})
    assert not is_fsdp_strategy(SkrullStrategy(bucket_size=BUCKET))


@pytest.mark.parametrize(
    ("class_path", "expected"),
    [("lightning_skrull.SkrullFSDPStrategy", True), ("lightning_skrull.SkrullStrategy", False)],
)
def test_cli_loads_on_rank_zero_under_the_fsdp_strategy(
    saved: Path, tmp_path: Path, class_path: str, expected: bool
) -> None:
    path = tmp_path / "recipe.yaml"
    recipe = {
        "trainer": {"devices": 1, "strategy": {"class_path": class_path}},
        "model": {"model": str(saved)},
    }
    path.write_text(yaml.safe_dump(recipe))

    def load_on_rank_zero(*args: str) -> bool | None:
        cli = built_cli("--config", str(path), *args)
        return cli.model.hparams.load_on_rank_zero  # type: ignore[no-any-return]

    assert load_on_rank_zero() is expected
    assert load_on_rank_zero("--model.load_on_rank_zero=false") is False  # an explicit choice


# ----------------------------------------------------------------------------- refusals
class _MetaLM(PlainLM):
    """A module whose model another rank would hold: built on the meta device."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.model = tiny_qwen2()


@pytest.mark.parametrize("strategy", [SkrullStrategy, SkrullZero2Strategy])
def test_replicating_strategies_refuse_a_model_built_on_meta(
    world_of_one: None, strategy: type
) -> None:
    trainer = cpu_trainer(strategy(bucket_size=BUCKET), max_steps=1)
    data = SkrullDataModule(train_data=make_data(8), global_batch_size=GLOBAL_BATCH)
    with pytest.raises(ValueError, match=r"keeps a full copy.*Use SkrullFSDPStrategy"):
        trainer.fit(_MetaLM(), data)


# ----------------------------------------------------------------------------- MXFP4 checkpoints
def test_cli_dequantizes_mxfp4_experts_on_rank_zero_and_builds_them_on_meta(
    tmp_path: Path, as_rank: Any
) -> None:
    # A tiny gpt-oss stored as the released checkpoints are (experts in MXFP4, encoded by hand
    # from known codes and exponents): dequantize_mxfp4 gives rank 0 trainable bf16 experts
    # equal to the encoded values exactly (every FP4 value times a power of two is a bf16), and
    # the other ranks the same plain model on the meta device, config included.
    weights = save_mxfp4_gpt_oss(tmp_path / "oss")
    as_rank(0)
    loaded = SkrullCausalLM(
        model=str(tmp_path / "oss"), torch_dtype="bfloat16", dequantize_mxfp4=True,
        load_on_rank_zero=True,
    ).model  # fmt: skip
    for name, expected in weights.items():
        got = loaded.get_parameter(name)
        assert got.dtype == torch.bfloat16 and got.requires_grad
        assert torch.equal(got, expected), name
    assert {type(layer.mlp.experts).__name__ for layer in loaded.model.layers} == {"GptOssExperts"}
    as_rank(1)
    meta = SkrullCausalLM(
        model=str(tmp_path / "oss"), torch_dtype="bfloat16", dequantize_mxfp4=True,
        load_on_rank_zero=True,
    ).model  # fmt: skip
    assert all(p.is_meta for p in meta.parameters())
    shapes = {k: (v.shape, v.dtype) for k, v in loaded.state_dict().items()}
    assert {k: (v.shape, v.dtype) for k, v in meta.state_dict().items()} == shapes
    assert meta.config.to_dict() == loaded.config.to_dict()
    assert not hasattr(loaded.config, "quantization_config")
    # loaded in full on every rank (load_on_rank_zero=False), the same weights
    full = SkrullCausalLM(model=str(tmp_path / "oss"), dequantize_mxfp4=True).model
    assert all(torch.equal(full.get_parameter(n), w) for n, w in weights.items())


def test_dequantize_mxfp4_is_refused_without_an_mxfp4_checkpoint(saved: Path) -> None:
    with pytest.raises(ValueError, match=r"not an MXFP4-quantized checkpoint.*quant_method=None"):
        SkrullCausalLM(model=str(saved), dequantize_mxfp4=True)
    with pytest.raises(ValueError, match="a config dict builds random weights"):
        SkrullCausalLM(model={"model_type": "gpt_oss"}, dequantize_mxfp4=True)
